"""Write one sparse GGUF: the model's weights with every FFN's neurons reordered hot-first, the
down projection transposed, the predictors, the activation statistics and the placement.

The layout is documented in docs/sparse-gguf.md. In short, per layer N:

    blk.N.ffn_gate / ffn_up   rows permuted hot-first (quantized sources: whole block rows copied)
    blk.N.ffn_down_t.weight   [d_ff, d_model] (PyTorch shape): down transposed, rows permuted
    blk.N.fc1.weight          [r, d_model]    predictor, first layer
    blk.N.fc2.weight          [d_ff, r]       predictor, second layer (rows permuted)
    blk.N.fc2.bias            [d_ff]          F32; the per-layer decision threshold is folded in
    blk.N.act_freq            [d_ff] F32      activation frequency (descending after the permute)
    blk.N.gpu_idx             [d_ff] I32      1 = the neuron lives on the fast tier
    blk.N.gpu_bucket          [k]    I32      sorted fast-tier neuron indices (omitted when k = 0)

Reordering is a permutation of the neurons (rows of gate/up, columns of down, rows of fc2):
it changes no output. Everything else (attention, norms, embeddings, tokenizer metadata) is
copied from a GGUF source byte for byte, or converted from a Hugging Face source.

The file is written to a temporary name in the target directory and renamed at the end, so a
failure never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..config import FFN_KINDS, ModelConfig
from ..errors import SparseInferError
from .profile import Profile
from .train import Predictors, check_matches

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
OUTTYPES = ("f32", "f16")
# ModelConfig.arch -> general.architecture of the sparse GGUF. A GGUF source's metadata is copied
# whole (its architecture's own keys included); a Hugging Face source gets ``_hparams``'s keys,
# which describe llama and OPT blocks only (HF_ARCHS)
GGUF_ARCH_NAMES = {"llama": "llama", "opt": "opt", "qwen2": "qwen2", "qwen3": "qwen3",
                   "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "falcon": "falcon"}
HF_ARCHS = ("llama", "opt")
SKIP_KV = ("GGUF.", "general.architecture", "general.file_type", "general.alignment",
           "powerinfer.", "sparseinfer.", "split.")


@dataclass(frozen=True)
class ExportOptions:
    outtype: str = "f32"  # dtype of down_t, of converted (HF) weights and of fc1/fc2

    def __post_init__(self) -> None:
        if self.outtype not in OUTTYPES:
            raise SparseInferError(f"outtype: expected one of {list(OUTTYPES)}, got "
                                   f"{self.outtype!r}")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    n_tensors: int
    n_bytes: int
    hot_counts: tuple[int, ...]


@dataclass
class _Tensor:
    """One output tensor: PyTorch-order shape, ggml type, size, and a thunk making its data."""

    name: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    nbytes: int
    make: Callable[[], np.ndarray]
    source: str | None = None  # canonical name of the source tensor it reads (pages released)


# ---- paths -------------------------------------------------------------------------------------


def check_output_path(path: str | Path) -> Path:
    """Fail early (before hours of work) when ``path`` cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise SparseInferError(f"output: expected a file name, found a directory: {path}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SparseInferError(f"output directory does not exist: {parent}")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SparseInferError(f"output directory {parent} is not writable: "
                               f"{e.strerror or e}") from None
    return path


# ---- names and types ---------------------------------------------------------------------------


def gguf_names(arch: str) -> dict[str, str]:
    """The loader's GGUF name map for ``arch`` (GGUF prefix -> canonical prefix)."""
    from ..models.names import GGUF_ARCHS

    if arch not in GGUF_ARCHS:
        raise SparseInferError(f"unsupported architecture {arch!r} for a sparse GGUF: expected "
                               f"one of {sorted(GGUF_ARCHS)}")
    return GGUF_ARCHS[arch]


def _to_gguf_name(canon: str, names: dict[str, str]) -> str:
    """The GGUF name of a canonical tensor: the loader's map read backwards."""
    from ..models.names import source_name

    name = source_name(canon, names)
    if name is None:
        raise SparseInferError(f"no GGUF name for tensor {canon!r}")
    return name


def _float_type(outtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.F16 if outtype == "f16" else GGMLQuantizationType.F32


def _np_dtype(qtype) -> np.dtype:
    from gguf import GGMLQuantizationType as Q

    return {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16),
            Q.I32: np.dtype(np.int32)}[qtype]


def _float_tensor(name: str, arr_fn: Callable[[], np.ndarray], shape, qtype,
                  source: str | None = None) -> _Tensor:
    dt = _np_dtype(qtype)
    n = int(np.prod(shape)) * dt.itemsize
    return _Tensor(name, tuple(int(s) for s in shape), qtype, n,
                   lambda: np.ascontiguousarray(arr_fn(), dtype=dt), source)


# ---- the source's tensors, canonical name -> how to produce it -----------------------------------


class _Source:
    """Where weights come from: a GGUF file (raw bytes, quantization kept) or the loaded model."""

    def __init__(self, loaded, outtype: str):
        self.loaded = loaded
        self.cfg: ModelConfig = loaded.config
        self.outtype = outtype
        from ..models.loading import gguf_model_tensors

        self.reader = loaded.reader
        self.raw: dict[str, object] = gguf_model_tensors(loaded)  # canonical -> ReaderTensor
        if self.reader is not None:
            kept = {t.name for t in self.raw.values()}
            for t in self.reader.tensors:
                if t.name not in kept:
                    log.info("%s: dropping tensor %s (replaced by this export)", loaded.path,
                             t.name)
        self._state: dict[str, torch.Tensor] | None = None

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """Unfused per-projection float32 weights of the loaded model (canonical names)."""
        if self._state is None:
            self._state = unfuse(self.loaded.model)
        return self._state

    def float_array(self, canon: str) -> np.ndarray:
        """float32 numpy weights in PyTorch orientation (down_t sources transposed back)."""
        from ..models.loading import gguf_tensor_to_torch

        if canon in self.raw:
            return gguf_tensor_to_torch(self.raw[canon]).numpy()
        if canon.endswith("ffn.down.weight") and canon.replace("down", "down_t") in self.raw:
            return gguf_tensor_to_torch(self.raw[canon.replace("down", "down_t")]).numpy().T
        return self.canonical_state()[canon].float().numpy()

    def has_raw(self, canon: str) -> bool:
        return canon in self.raw

    def release(self, canon: str | None) -> None:
        """Drop the mapped pages of the source tensor(s) behind ``canon`` from this process's
        resident set once its output is written: read through the file's map, every source
        tensor would otherwise stay resident to the end (a 7B convert peaked 30% over the file
        size). The pages stay in the page cache; a later read maps them again."""
        from ..fileio import drop_pages

        if canon is None:
            return
        for c in (canon, canon.replace("ffn.down.", "ffn.down_t.")):
            t = self.raw.get(c)
            if t is not None:
                drop_pages(np.asarray(t.data))


def unfuse(model) -> dict[str, torch.Tensor]:
    """Canonical per-projection float tensors of a Transformer with float projections (the
    inverse of the fusing that ``models/build.py`` does when it fills q/k/v and gate/up)."""
    cfg = model.cfg
    hd = cfg.head_dim
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
    s: dict[str, torch.Tensor] = {"tok_emb.weight": model.tok_emb.weight}
    if model.pos_emb is not None:
        s["pos_emb.weight"] = model.pos_emb.weight
    for i, blk in enumerate(model.layers):
        p = f"layers.{i}."
        for nn_, norm in (("attn_norm", blk.attn_norm), ("ffn_norm", blk.ffn_norm)):
            s[p + nn_ + ".weight"] = norm.weight
            if norm.bias is not None:
                s[p + nn_ + ".bias"] = norm.bias
        for n, t in zip(("wq", "wk", "wv"), blk.attn.wqkv.weight.split([q_out, kv_out, kv_out])):
            s[p + f"attn.{n}.weight"] = t
        if blk.attn.wqkv.bias is not None:
            for n, t in zip(("wq", "wk", "wv"), blk.attn.wqkv.bias.split([q_out, kv_out, kv_out])):
                s[p + f"attn.{n}.bias"] = t
        s[p + "attn.wo.weight"] = blk.attn.wo.weight
        if blk.attn.wo.bias is not None:
            s[p + "attn.wo.bias"] = blk.attn.wo.bias
        w_in = blk.ffn.w_in.weight
        if blk.ffn.gated:
            s[p + "ffn.gate.weight"], s[p + "ffn.up.weight"] = w_in.split(cfg.d_ff)
        else:
            s[p + "ffn.up.weight"] = w_in
            if blk.ffn.w_in.bias is not None:
                s[p + "ffn.up.bias"] = blk.ffn.w_in.bias
        s[p + "ffn.down.weight"] = blk.ffn.down.weight
        if blk.ffn.down.bias is not None:
            s[p + "ffn.down.bias"] = blk.ffn.down.bias
    s["norm.weight"] = model.norm.weight
    if model.norm.bias is not None:
        s["norm.bias"] = model.norm.bias
    if not cfg.tie_embeddings:
        s["lm_head.weight"] = model.lm_head.weight
    return {k: v.detach().float() for k, v in s.items()}


def canonical_names(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor name of a model with this config, in file order."""
    names = ["tok_emb.weight"] + (["pos_emb.weight"] if cfg.pos == "learned" else [])
    kind = FFN_KINDS[cfg.ffn_kind]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        names.append(p + "attn_norm.weight")
        if cfg.norm == "layer":
            names.append(p + "attn_norm.bias")
        for n in ("wq", "wk", "wv", "wo"):
            names.append(p + f"attn.{n}.weight")
            if cfg.attn_bias:
                names.append(p + f"attn.{n}.bias")
        names.append(p + "ffn_norm.weight")
        if cfg.norm == "layer":
            names.append(p + "ffn_norm.bias")
        if kind.gated:
            names.append(p + "ffn.gate.weight")
        names.append(p + "ffn.up.weight")
        if cfg.ffn_bias:
            names.append(p + "ffn.up.bias")
        names.append(p + "ffn.down.weight")
        if cfg.ffn_bias:
            names.append(p + "ffn.down.bias")
    names.append("norm.weight")
    if cfg.norm == "layer":
        names.append("norm.bias")
    if not cfg.tie_embeddings:
        names.append("lm_head.weight")
    return names


def _model_tensor_names(src: _Source) -> list[str]:
    """``canonical_names`` plus, from a GGUF source, every other model tensor it holds that the
    architecture adds (q/k/v biases, q/k norms, post-norms, rope factors...), in file order.
    The FFN's own tensors and a source's predictors are not among them: the export writes its
    own."""
    names = canonical_names(src.cfg)
    if src.raw:  # what the file holds (fused q/k/v, no FFN norm of Falcon-7B...); FFN rows
        names = [n for n in names if n in src.raw or ".ffn." in n]  # are written anew below
        # Phi-3: gate and up are one tensor, written as it is (its rows permuted per half)
        fused = {n.replace(".ffn.w_in.", ".ffn.gate.") for n in src.raw if ".ffn.w_in." in n}
        fused |= {n.replace(".gate.", ".up.") for n in fused}
        names = [n.replace(".ffn.gate.", ".ffn.w_in.") if n in fused and ".gate." in n else n
                 for n in names if not (n in fused and ".up." in n)]
    known = set(names)
    for canon in src.raw:
        if canon in known or ".ffn." in canon or not canon.endswith((".weight", ".bias")):
            continue
        names.append(canon)
    return names


# ---- the tensor plan ---------------------------------------------------------------------------


def _layer_of(canon: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", canon)
    return int(m.group(1)) if m else None


def plan_model_tensors(src: _Source, perms: list[np.ndarray] | None) -> list[_Tensor]:
    """The model's own tensors as they will be stored (``perms``: per-layer neuron order, or
    None for the source order)."""
    from ..models.loading import permute_qk

    cfg = src.cfg
    names = gguf_names(cfg.arch)
    ftype = _float_type(src.outtype)
    out: list[_Tensor] = []
    for canon in _model_tensor_names(src):
        layer = _layer_of(canon)
        perm = perms[layer] if (perms is not None and layer is not None) else None
        is_rows = canon.endswith(("ffn.gate.weight", "ffn.up.weight", "ffn.up.bias",
                                  "ffn.w_in.weight"))
        if perm is not None and canon.endswith("ffn.w_in.weight"):  # gate rows, then up's
            perm = np.concatenate([perm, perm + cfg.d_ff])
        if canon.endswith("ffn.down.weight"):  # -> down_t, rows permuted
            name = _to_gguf_name(canon.replace("ffn.down.", "ffn.down_t."), names)

            def make(canon=canon, perm=perm):
                t = src.float_array(canon).T
                return t if perm is None else t[perm]

            out.append(_float_tensor(name, make, (cfg.d_ff, cfg.d_model), ftype, canon))
            continue
        name = _to_gguf_name(canon, names)
        if src.has_raw(canon):  # GGUF source: keep the stored type, copy bytes (permuted rows)
            t = src.raw[canon]
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))

            def make(t=t, perm=perm, rows=is_rows):
                data = np.asarray(t.data)
                return np.ascontiguousarray(data[perm] if (rows and perm is not None) else data)

            out.append(_Tensor(name, shape, t.tensor_type, int(t.n_bytes), make, canon))
            continue
        # Hugging Face source: float weights from the model, llama.cpp's Q/K row order
        n_heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(canon.split(".")[-2])
        needs_qk = cfg.pos == "rope" and ".attn." in canon and n_heads is not None
        is_vec = canon.endswith(".bias") or "norm" in canon
        qtype = _float_type("f32") if is_vec else ftype  # norms and biases stay F32

        def make(canon=canon, perm=perm, rows=is_rows, n_heads=n_heads, qk=needs_qk):
            a = src.float_array(canon)
            if qk:
                a = permute_qk(torch.from_numpy(np.ascontiguousarray(a)), n_heads).numpy()
            return a[perm] if (rows and perm is not None) else a

        shape = tuple(src.canonical_state()[canon].shape)
        out.append(_float_tensor(name, make, shape, qtype))
    return out


def plan_sparse_tensors(profile: Profile, predictors: Predictors, perms: list[np.ndarray],
                        hot: list[np.ndarray], outtype: str) -> list[_Tensor]:
    from gguf import GGMLQuantizationType as Q

    ftype = _float_type(outtype)
    out = []
    F = profile.d_ff
    freqs = profile.freqs
    for l, p in enumerate(predictors.layers):
        perm = perms[l]
        inv = np.empty_like(perm)
        inv[perm] = np.arange(F)
        bucket = np.sort(inv[hot[l]]).astype(np.int32)
        out += [
            _float_tensor(f"blk.{l}.fc1.weight", lambda p=p: p.fc1, p.fc1.shape, ftype),
            _float_tensor(f"blk.{l}.fc2.weight", lambda p=p, s=perm: p.fc2[s], p.fc2.shape, ftype),
            _float_tensor(f"blk.{l}.fc2.bias", lambda p=p, s=perm: p.bias[s], (F,), Q.F32),
            _float_tensor(f"blk.{l}.act_freq", lambda s=perm, l=l: freqs[l][s], (F,), Q.F32),
        ]
        mask = np.zeros(F, dtype=np.int32)
        mask[bucket] = 1
        out.append(_float_tensor(f"blk.{l}.gpu_idx", lambda m=mask: m, (F,), Q.I32))
        if bucket.size:  # GGUF has no empty tensors: a layer without fast neurons has no bucket
            out.append(_float_tensor(f"blk.{l}.gpu_bucket", lambda b=bucket: b, bucket.shape,
                                     Q.I32))
    return out


def hot_first_permutations(freqs: np.ndarray) -> list[np.ndarray]:
    """Per layer: neuron indices by descending activation frequency (stable on ties)."""
    return [np.argsort(-f, kind="stable") for f in freqs]


# ---- placement sizes ---------------------------------------------------------------------------


def stored_sizes(loaded, outtype: str = "f32") -> dict[str, int]:
    """Bytes of each of the model's tensors as this exporter stores them, by GGUF name."""
    return {t.name: t.nbytes for t in plan_model_tensors(_Source(loaded, outtype), None)}


def neuron_bytes(sizes: dict[str, int], n_layers: int, d_ff: int) -> tuple[int, ...]:
    """Per layer: bytes of one neuron's gate + up (+ up bias) rows and its down_t row."""
    out = []
    for l in range(n_layers):
        parts = [f"blk.{l}.ffn_gate.weight", f"blk.{l}.ffn_up.weight", f"blk.{l}.ffn_up.bias",
                 f"blk.{l}.ffn_down_t.weight"]
        out.append(sum(sizes.get(n, 0) for n in parts) // d_ff)
    return tuple(out)


def dense_parts(sizes: dict[str, int], cfg: ModelConfig, ctx: int, predictors: Predictors,
                outtype: str = "f32", kv_bytes_per_value: int = 4) -> tuple[tuple[str, int], ...]:
    """The parts every token needs, in the order the fast tier is charged: embeddings, the KV
    cache for ``ctx`` tokens, attention, predictors, norms (and the FFN down biases)."""
    emb = sum(v for k, v in sizes.items()
              if k.split(".")[0] in ("token_embd", "position_embd", "output"))
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * ctx * kv_bytes_per_value
    attn = sum(v for k, v in sizes.items() if re.match(r"blk\.\d+\.attn_(q|k|v|output)\.", k))
    w = 2 if outtype == "f16" else 4
    pred = sum((p.fc1.size + p.fc2.size) * w + p.bias.size * 4 for p in predictors.layers)
    norms = sum(v for k, v in sizes.items() if "norm" in k or k.endswith("ffn_down.bias"))
    return (("embeddings", int(emb)), ("kv_cache", int(kv)), ("attention", int(attn)),
            ("predictors", int(pred)), ("norms", int(norms)))


# ---- metadata ----------------------------------------------------------------------------------


def _copy_fields(writer, reader, keep: Callable[[str], bool]) -> None:
    from gguf import GGUFValueType

    for key, f in reader.fields.items():
        if not keep(key) or not f.types:
            continue
        value = f.contents()
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        if sub is not None and len(value) == 0:
            continue
        writer.add_key_value(key, value, f.types[0], sub_type=sub)


def _hparams(writer, cfg: ModelConfig) -> None:
    a = GGUF_ARCH_NAMES[cfg.arch]
    writer.add_uint32(f"{a}.context_length", cfg.max_seq_len)
    writer.add_uint32(f"{a}.embedding_length", cfg.d_model)
    writer.add_uint32(f"{a}.block_count", cfg.n_layers)
    writer.add_uint32(f"{a}.feed_forward_length", cfg.d_ff)
    writer.add_uint32(f"{a}.attention.head_count", cfg.n_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", cfg.n_kv_heads)
    writer.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    if cfg.norm == "rms":
        writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    else:
        writer.add_float32(f"{a}.attention.layer_norm_epsilon", cfg.norm_eps)
    if cfg.pos == "rope":
        writer.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
        writer.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
        writer.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
        writer.add_uint32(f"{a}.attention.value_length", cfg.head_dim)


def hf_tokenizer_fields(path: Path, tokenizer, vocab_size: int) -> dict[str, tuple]:
    """GGUF tokenizer metadata (key -> (value, type, sub_type)) from a Hugging Face directory.

    A byte-level BPE tokenizer.json becomes llama.cpp's ``gpt2`` model (tokens, merges, token
    types, pre-tokenizer name); anything else is embedded whole as ``tokenizer.huggingface.json``
    (which our loader reads; llama.cpp does not).
    """
    from gguf import GGUFValueType as V
    from gguf import Keys, TokenType

    raw = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    out: dict[str, tuple] = {}
    pre = _pre_tokenizer_name(raw.get("pre_tokenizer"))
    model = raw.get("model") or {}
    if model.get("type") == "BPE" and pre is not None and not model.get("byte_fallback"):
        vocab: dict[str, int] = dict(model.get("vocab") or {})
        special, added = set(), set()
        for t in raw.get("added_tokens") or []:
            vocab[t["content"]] = int(t["id"])
            (special if t.get("special") else added).add(int(t["id"]))
        n = max(vocab_size, max(vocab.values()) + 1)
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [int(TokenType.UNUSED)] * n
        for text, i in vocab.items():
            tokens[i] = text
            types[i] = int(TokenType.CONTROL if i in special else
                           TokenType.USER_DEFINED if i in added else TokenType.NORMAL)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        out[Keys.Tokenizer.MODEL] = ("gpt2", V.STRING, None)
        out[Keys.Tokenizer.PRE] = (pre, V.STRING, None)
        out[Keys.Tokenizer.LIST] = (tokens, V.ARRAY, V.STRING)
        out[Keys.Tokenizer.TOKEN_TYPE] = (types, V.ARRAY, V.INT32)
        if merges:
            out[Keys.Tokenizer.MERGES] = (merges, V.ARRAY, V.STRING)
    else:
        log.warning("%s: tokenizer is not a byte-level BPE of a known pre-tokenizer; embedding "
                    "tokenizer.json whole (llama.cpp will not read it)", path)
        out[Keys.Tokenizer.HF_JSON] = (json.dumps(raw, ensure_ascii=False), V.STRING, None)
    if tokenizer.bos_id is not None:
        out[Keys.Tokenizer.BOS_ID] = (int(tokenizer.bos_id), V.UINT32, None)
    if tokenizer.eos_id is not None:
        out[Keys.Tokenizer.EOS_ID] = (int(tokenizer.eos_id), V.UINT32, None)
    out[Keys.Tokenizer.ADD_BOS] = (bool(tokenizer.add_bos), V.BOOL, None)
    if tokenizer.chat_template:
        out[Keys.Tokenizer.CHAT_TEMPLATE] = (tokenizer.chat_template, V.STRING, None)
    return out


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for the byte-level pre-tokenizers we can name."""
    def byte_level(p):
        return (p.get("type") == "ByteLevel" and p.get("use_regex", True)
                and not p.get("add_prefix_space", False))

    if not pre:
        return None
    if byte_level(pre):
        return "gpt2"
    if pre.get("type") == "Sequence":
        ps = pre.get("pretokenizers") or []
        if len(ps) == 2 and ps[0].get("type") == "Digits" and ps[0].get("individual_digits") \
                and byte_level(ps[1]):
            return "smollm"
    return None


def _sparse_metadata(writer, cfg: ModelConfig, profile: Profile, predictors: Predictors,
                     placement, hot_counts: list[int]) -> None:
    from gguf import GGUFValueType as V

    def farr(key, values):
        writer.add_key_value(key, [float(v) for v in values], V.ARRAY, sub_type=V.FLOAT32)

    def iarr(key, values):
        writer.add_key_value(key, [int(v) for v in values], V.ARRAY, sub_type=V.INT32)

    writer.add_float32("powerinfer.sparse_threshold", 0.0)
    writer.add_uint32("sparseinfer.format_version", FORMAT_VERSION)
    writer.add_string("sparseinfer.ffn_kind", cfg.ffn_kind)
    # Q/K rows are written in llama.cpp's order: read back with rope over adjacent pairs
    stored = replace(cfg, rope_interleaved=cfg.pos == "rope")
    writer.add_string("sparseinfer.config", json.dumps(asdict(stored)))
    writer.add_string("sparseinfer.neuron_order", "act_freq_desc")
    writer.add_string("sparseinfer.sparsity.mode", profile.mode)
    writer.add_string("sparseinfer.sparsity.score", profile.score or "output")
    dens = profile.densities
    target = profile.target_density if profile.target_density is not None else float(dens.mean())
    writer.add_float32("sparseinfer.sparsity.target_density", float(target))
    farr("sparseinfer.sparsity.layer_thresholds", profile.thresholds)
    farr("sparseinfer.sparsity.layer_densities", dens)
    writer.add_uint64("sparseinfer.profile.tokens", int(profile.n_tokens))
    writer.add_bool("sparseinfer.predictor.threshold_folded", True)
    writer.add_float32("sparseinfer.predictor.recall_target", predictors.options.recall)
    iarr("sparseinfer.predictor.ranks", [p.rank for p in predictors.layers])
    farr("sparseinfer.predictor.recall", [p.recall for p in predictors.layers])
    farr("sparseinfer.predictor.precision", [p.precision for p in predictors.layers])
    farr("sparseinfer.predictor.density", [p.pred_density for p in predictors.layers])
    writer.add_uint64("sparseinfer.placement.budget_bytes",
                      int(placement.budget_bytes) if placement is not None else 0)
    writer.add_uint64("sparseinfer.placement.fast_bytes",
                      int(placement.fast_bytes) if placement is not None else 0)
    writer.add_string("sparseinfer.placement.status",
                      placement.status if placement is not None else "none")
    iarr("sparseinfer.placement.hot_counts", hot_counts)


# ---- export ------------------------------------------------------------------------------------


def export_sparse_gguf(loaded, profile: Profile, predictors: Predictors, out_path: str | Path,
                       placement=None, options: ExportOptions = ExportOptions(),
                       progress: Callable[[str, int, int], Callable[[int], None]] | None = None
                       ) -> ExportResult:
    """Write the sparse GGUF for ``loaded`` (see the module docstring); returns a summary.

    ``placement`` is a ``solve.PlacementSolution`` over the profile's (original) neuron indices,
    or None (nothing on the fast tier). ``progress("export", total_bytes, "B")`` (optional) makes
    a callback called with the bytes just written.
    """
    from gguf import GGUFWriter

    cfg: ModelConfig = loaded.config
    out_path = check_output_path(out_path)
    if cfg.arch not in GGUF_ARCH_NAMES:
        raise SparseInferError(f"unsupported architecture {cfg.arch!r}: expected one of "
                               f"{sorted(GGUF_ARCH_NAMES)}")
    if loaded.format != "gguf" and cfg.arch not in HF_ARCHS:
        raise SparseInferError(
            f"{loaded.path}: a sparse GGUF of a {cfg.arch} model is written from a GGUF source "
            f"(its metadata is copied); from Hugging Face files only {list(HF_ARCHS)}: convert "
            f"the model with llama.cpp's convert_hf_to_gguf.py first")
    if (profile.n_layers, profile.d_model, profile.d_ff) != (cfg.n_layers, cfg.d_model, cfg.d_ff):
        raise SparseInferError(
            f"profile {profile.path}: expected a profile of this model ({cfg.n_layers} layers, "
            f"d_model {cfg.d_model}, d_ff {cfg.d_ff}), found {profile.n_layers} layers, "
            f"d_model {profile.d_model}, d_ff {profile.d_ff}")
    if profile.ffn_kind != cfg.ffn_kind:
        raise SparseInferError(f"profile {profile.path}: expected FFN kind {cfg.ffn_kind!r}, "
                               f"found {profile.ffn_kind!r}")
    check_matches(predictors, profile)
    if placement is not None:
        if tuple(len(h) for h in placement.hot) != tuple(placement.hot_counts) or \
                len(placement.hot) != cfg.n_layers:
            raise SparseInferError(f"placement: expected {cfg.n_layers} layers, found "
                                   f"{len(placement.hot)}")
        hot = [np.asarray(h, dtype=np.int64) for h in placement.hot]
    else:
        hot = [np.zeros(0, dtype=np.int64) for _ in range(cfg.n_layers)]

    src = _Source(loaded, options.outtype)
    perms = hot_first_permutations(profile.freqs)
    tensors = plan_model_tensors(src, perms) + plan_sparse_tensors(
        profile, predictors, perms, hot, options.outtype)

    arch = GGUF_ARCH_NAMES[cfg.arch]
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp",
                                    dir=out_path.parent if str(out_path.parent) else ".")
    os.close(fd)
    tmp = Path(tmp_name)
    writer = GGUFWriter(tmp, arch)
    try:
        if src.reader is not None:
            _copy_fields(writer, src.reader, lambda k: not k.startswith(SKIP_KV))
        else:
            writer.add_name(cfg.name or loaded.path.name)
            _hparams(writer, cfg)
            for key, (value, vt, sub) in hf_tokenizer_fields(loaded.path, loaded.tokenizer,
                                                             cfg.vocab_size).items():
                writer.add_key_value(key, value, vt, sub_type=sub)
        _sparse_metadata(writer, cfg, profile, predictors, placement, [len(h) for h in hot])
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                                   raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(t.nbytes for t in tensors)
        tick = progress("export", total, "B") if progress else None
        for t in tensors:
            data = t.make()
            if data.nbytes != t.nbytes:
                raise SparseInferError(f"tensor {t.name}: expected {t.nbytes} bytes, produced "
                                       f"{data.nbytes}")
            writer.write_tensor_data(data)
            del data
            src.release(t.source)
            if tick:
                tick(t.nbytes)
        writer.close()
        os.replace(tmp, out_path)
    except OSError as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise SparseInferError(f"{out_path}: cannot write: {e.strerror or e}") from None
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    n_bytes = out_path.stat().st_size
    log.info("wrote %s: %d tensors, %.1f MiB", out_path, len(tensors), n_bytes / 2**20)
    return ExportResult(out_path, len(tensors), n_bytes, tuple(len(h) for h in hot))
