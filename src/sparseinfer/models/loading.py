"""Read a model file (GGUF, or a Hugging Face directory with safetensors) into a ``Transformer``.

Checkpoint names are data: each format has a map from its tensor names to our canonical names
(``layers.{i}.attn.wq.weight`` ...); the model fuses them. Every failure becomes one
``ModelFileError`` that names the file and what was expected and found.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import FFN_KINDS, ModelConfig
from ..errors import ModelFileError, SparseInferError
from ..fileio import read_json
from .model import Transformer

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

# ---- name maps (source prefix -> canonical prefix; ".weight"/".bias" carried over) -------------

GGUF_LLAMA_NAMES = {
    "token_embd": "tok_emb",
    "output_norm": "norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "layers.{i}.attn_norm",
    "blk.{i}.attn_q": "layers.{i}.attn.wq",
    "blk.{i}.attn_k": "layers.{i}.attn.wk",
    "blk.{i}.attn_v": "layers.{i}.attn.wv",
    "blk.{i}.attn_output": "layers.{i}.attn.wo",
    "blk.{i}.ffn_norm": "layers.{i}.ffn_norm",
    "blk.{i}.ffn_gate": "layers.{i}.ffn.gate",
    "blk.{i}.ffn_up": "layers.{i}.ffn.up",
    "blk.{i}.ffn_down": "layers.{i}.ffn.down",
    "blk.{i}.ffn_down_t": "layers.{i}.ffn.down_t",  # sparse GGUFs store down transposed
}

GGUF_OPT_NAMES = {  # sparseinfer's own GGUF layout for OPT-style models (llama.cpp has none)
    "token_embd": "tok_emb",
    "position_embd": "pos_emb",
    "output_norm": "norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "layers.{i}.attn_norm",
    "blk.{i}.attn_q": "layers.{i}.attn.wq",
    "blk.{i}.attn_k": "layers.{i}.attn.wk",
    "blk.{i}.attn_v": "layers.{i}.attn.wv",
    "blk.{i}.attn_output": "layers.{i}.attn.wo",
    "blk.{i}.ffn_norm": "layers.{i}.ffn_norm",
    "blk.{i}.ffn_up": "layers.{i}.ffn.up",
    "blk.{i}.ffn_down": "layers.{i}.ffn.down",
    "blk.{i}.ffn_down_t": "layers.{i}.ffn.down_t",
}

HF_LLAMA_NAMES = {
    "model.embed_tokens": "tok_emb",
    "model.norm": "norm",
    "lm_head": "lm_head",
    "model.layers.{i}.input_layernorm": "layers.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj": "layers.{i}.attn.wq",
    "model.layers.{i}.self_attn.k_proj": "layers.{i}.attn.wk",
    "model.layers.{i}.self_attn.v_proj": "layers.{i}.attn.wv",
    "model.layers.{i}.self_attn.o_proj": "layers.{i}.attn.wo",
    "model.layers.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "model.layers.{i}.mlp.gate_proj": "layers.{i}.ffn.gate",
    "model.layers.{i}.mlp.up_proj": "layers.{i}.ffn.up",
    "model.layers.{i}.mlp.down_proj": "layers.{i}.ffn.down",
}

HF_OPT_NAMES = {
    "model.decoder.embed_tokens": "tok_emb",
    "model.decoder.embed_positions": "pos_emb",
    "model.decoder.final_layer_norm": "norm",
    "lm_head": "lm_head",
    "model.decoder.layers.{i}.self_attn_layer_norm": "layers.{i}.attn_norm",
    "model.decoder.layers.{i}.self_attn.q_proj": "layers.{i}.attn.wq",
    "model.decoder.layers.{i}.self_attn.k_proj": "layers.{i}.attn.wk",
    "model.decoder.layers.{i}.self_attn.v_proj": "layers.{i}.attn.wv",
    "model.decoder.layers.{i}.self_attn.out_proj": "layers.{i}.attn.wo",
    "model.decoder.layers.{i}.final_layer_norm": "layers.{i}.ffn_norm",
    "model.decoder.layers.{i}.fc1": "layers.{i}.ffn.up",
    "model.decoder.layers.{i}.fc2": "layers.{i}.ffn.down",
}

# HF config "hidden_act" -> our FFN kind for gated (llama-style) MLPs
GATED_ACT_TO_KIND = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
                     "gelu_pytorch_tanh": "geglu", "relu": "reglu", "drelu": "drelu"}
UNGATED_ACT_TO_KIND = {"relu": "relu", "gelu": "gelu"}

HF_ARCHS = {  # config.json "architectures"[0] -> (family, name map)
    "LlamaForCausalLM": ("llama", HF_LLAMA_NAMES),
    "MistralForCausalLM": ("llama", HF_LLAMA_NAMES),
    "OPTForCausalLM": ("opt", HF_OPT_NAMES),
}
GGUF_ARCHS = {"llama": GGUF_LLAMA_NAMES, "opt": GGUF_OPT_NAMES}


def _compile(names: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    out = []
    for src, dst in names.items():
        pat = re.escape(src).replace(re.escape("{i}"), r"(?P<i>\d+)")
        out.append((re.compile(pat + r"\.(?P<suffix>weight|bias)$"), dst))
    return out


def source_name(canon: str, names: dict[str, str]) -> str | None:
    """The checkpoint's name for a canonical tensor name under the map ``names`` (None: none)."""
    m = re.match(r"^(?:layers\.(\d+)\.)?(.*)\.(weight|bias)$", canon)
    if m:
        i, rest, suffix = m.groups()
        for src, dst in names.items():
            if dst == (f"layers.{{i}}.{rest}" if i is not None else rest):
                return src.replace("{i}", i or "") + "." + suffix
    return None


def map_name(name: str, compiled: list[tuple[re.Pattern, str]]) -> str | None:
    for pat, dst in compiled:
        m = pat.match(name)
        if m:
            d = m.groupdict()
            return dst.replace("{i}", d.get("i") or "") + "." + d["suffix"]
    return None


# ---- result ------------------------------------------------------------------------------------


@dataclass
class TensorInfo:
    name: str
    kind: str  # ggml type name or torch dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any  # sparseinfer.tokenizer.Tokenizer
    path: Path
    format: str  # "gguf" | "hf"
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # non-model tensors (predictors…)
    reader: Any = None  # the GGUF file's gguf.GGUFReader (its tensors are memory-mapped)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def file_bytes(self) -> int:
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.glob("*.safetensors"))
        return self.path.stat().st_size


def load_model(path: str | Path, dtype: str = "fp32", max_seq_len: int | None = None,
               ffn_kind: str | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory (config.json + *.safetensors + tokenizer).

    ``ffn_kind`` overrides the FFN kind recorded in (or inferred from) the file.
    """
    path = Path(path)
    if dtype not in DTYPES:
        raise SparseInferError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if not path.exists():
        raise SparseInferError(f"model not found: {path}")
    if path.is_dir():
        return _load_hf(path, DTYPES[dtype], max_seq_len, ffn_kind)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, DTYPES[dtype], max_seq_len, ffn_kind)
    raise ModelFileError(
        f"{path}: not a model file: expected a GGUF file (magic b'GGUF') or a Hugging Face "
        f"directory, found magic {magic!r}"
    )


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, path: Path,
           canon_to_src: dict[str, str], names: dict[str, str]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        model.load_state(state, dtype)
    except KeyError as e:
        name = e.args[0]
        raise ModelFileError(
            f"{path}: missing tensor {source_name(name, names) or name!r} "
            f"(expected for a {cfg.arch} model with {cfg.n_layers} layers)"
        ) from None
    except ValueError as e:
        msg = str(e)
        for canon, src in canon_to_src.items():
            msg = msg.replace(f"tensor {canon}:", f"tensor {src!r}:")
        raise ModelFileError(f"{path}: {msg}") from None
    return model


# ---- GGUF --------------------------------------------------------------------------------------


def _field_value(field_) -> Any:
    """Decode a GGUFReader field into a Python scalar, string or list."""
    from gguf import GGUFValueType

    types = field_.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field_.parts[i]).decode("utf-8", errors="replace") for i in field_.data]
        return [field_.parts[i].tolist()[0] for i in field_.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field_.parts[field_.data[0]]).decode("utf-8", errors="replace")
    return field_.parts[field_.data[0]].tolist()[0]


def read_gguf_metadata(reader, skip_arrays_longer_than: int = 64) -> dict[str, Any]:
    meta = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if (name.startswith("tokenizer.") and f.types and f.types[0].name == "ARRAY"
                and len(f.data) > skip_arrays_longer_than):
            meta[name] = f"<array of {len(f.data)}>"
            continue
        meta[name] = _field_value(f)
    return meta


def open_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad bytes
        raise ModelFileError(f"{path}: not a valid GGUF file (truncated or corrupt?): {e}") from None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved -> rotate-half rope)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert-time Q/K row permutation (rotate-half -> interleaved rope)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def gguf_tensor_to_torch(t) -> torch.Tensor:
    """Dequantize one ReaderTensor to a float32 torch tensor in row-major (PyTorch) shape."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if t.tensor_type == GGMLQuantizationType.F32:
        arr = np.array(t.data, dtype=np.float32)  # copy: the reader's memmap is read-only
    elif t.tensor_type == GGMLQuantizationType.F16:
        arr = np.asarray(t.data).astype(np.float32)
    else:
        arr = quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def _gguf_llama_config(path, arch, meta, names, kind, max_seq_len, key, reader) -> ModelConfig:
    """ModelConfig from llama.cpp's standard ``{arch}.*`` metadata keys."""
    n_heads = int(key("attention.head_count"))
    d_model = int(key("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ModelFileError(f"{path}: missing both '{arch}.vocab_size' and the tokenizer vocab")
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    ctx = int(key("context_length"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        d_ff=int(key("feed_forward_length")),
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
        head_dim=int(key("attention.key_length", d_model // n_heads)),
        ffn_kind=kind,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in names,
        name=str(meta.get("general.name", path.stem)),
    )


def _load_gguf(path: Path, dtype: torch.dtype, max_seq_len: int | None,
               ffn_kind: str | None) -> LoadedModel:
    from ..tokenizer import Tokenizer

    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r}; expected one of {sorted(GGUF_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}

    def key(k: str, default: Any = ...) -> Any:
        v = meta.get(f"{arch}.{k}", default)
        if v is ...:
            raise ModelFileError(f"{path}: missing metadata key '{arch}.{k}'")
        return v

    kind = ffn_kind or meta.get("sparseinfer.ffn_kind")
    if kind is None:
        # PowerInfer's sparse GGUFs (predictors present) are ReLU-family llama models
        kind = "reglu" if "blk.0.fc1.weight" in names else "swiglu"
    try:
        if "sparseinfer.config" in meta:  # written by our exporter: the whole ModelConfig
            fields = json.loads(meta["sparseinfer.config"])
            fields["ffn_kind"] = kind
            if max_seq_len:
                fields["max_seq_len"] = min(fields["max_seq_len"], max_seq_len)
            cfg = ModelConfig(**fields)
        else:
            cfg = _gguf_llama_config(path, arch, meta, names, kind, max_seq_len, key, reader)
    except (ValueError, TypeError) as e:
        raise ModelFileError(f"{path}: inconsistent hyper-parameters: {e}") from None
    if "rope_freqs.weight" in names:
        raise ModelFileError(f"{path}: rope frequency factors (Llama-3.1 rope scaling) are not "
                             f"supported yet")

    compiled = _compile(GGUF_ARCHS[arch])
    state: dict[str, torch.Tensor] = {}
    canon_to_src: dict[str, str] = {}
    extras: dict[str, np.ndarray] = {}
    infos = []
    for t in reader.tensors:
        infos.append(TensorInfo(t.name, t.tensor_type.name,
                                tuple(int(n) for n in reversed(t.shape.tolist())),
                                int(t.n_bytes)))
        canon = map_name(t.name, compiled)
        try:
            if canon is None:
                extras[t.name] = np.array(t.data)  # predictors, placement, statistics
                continue
            w = gguf_tensor_to_torch(t)
        except Exception as e:
            raise ModelFileError(f"{path}: cannot read tensor {t.name!r} "
                                 f"(truncated or corrupt file?): {e}") from None
        if cfg.pos == "rope" and canon.endswith(("attn.wq.weight", "attn.wq.bias")):
            w = unpermute_qk(w, cfg.n_heads)
        elif cfg.pos == "rope" and canon.endswith(("attn.wk.weight", "attn.wk.bias")):
            w = unpermute_qk(w, cfg.n_kv_heads)
        elif canon.endswith("ffn.down_t.weight"):
            w, canon = w.t(), canon.replace("down_t", "down")
        state[canon] = w.to(dtype)
        canon_to_src[canon] = t.name
    model = _build(cfg, state, dtype, path, canon_to_src, GGUF_ARCHS[arch])
    try:
        tokenizer = Tokenizer.from_gguf(reader, path)
    except SparseInferError:
        raise
    except Exception as e:
        raise ModelFileError(f"{path}: cannot build the tokenizer from its metadata: {e}") from None
    log.info("loaded %s: %s, %d layers, d_model %d, ffn %s", path, arch, cfg.n_layers,
             cfg.d_model, cfg.ffn_kind)
    return LoadedModel(model, tokenizer, path, "gguf", meta, infos, extras, reader)


def gguf_model_tensors(loaded: LoadedModel) -> dict[str, Any]:
    """Canonical name -> ``gguf`` ReaderTensor (raw blocks, quantization as stored) for every
    model tensor of a loaded GGUF, from the reader ``load_model`` already opened (parsing a GGUF
    again costs seconds); empty for other formats. Non-model tensors are left out."""
    if loaded.reader is None:
        return {}
    compiled = _compile(GGUF_ARCHS[str(loaded.metadata.get("general.architecture"))])
    out = {}
    for t in loaded.reader.tensors:
        canon = map_name(t.name, compiled)
        if canon is not None:
            out[canon] = t
    return out


# ---- Hugging Face directory --------------------------------------------------------------------


def hf_config(path: Path, raw: dict[str, Any], max_seq_len: int | None,
              ffn_kind: str | None) -> tuple[ModelConfig, dict[str, str]]:
    archs = raw.get("architectures") or []
    arch_name = archs[0] if archs else None
    if arch_name not in HF_ARCHS:
        raise ModelFileError(f"{path / 'config.json'}: unsupported architecture {arch_name!r}; "
                             f"expected one of {sorted(HF_ARCHS)}")
    family, names = HF_ARCHS[arch_name]
    need = lambda k: _need(raw, k, path)  # noqa: E731
    if family == "opt":
        if not raw.get("do_layer_norm_before", True):
            raise ModelFileError(f"{path}: OPT with post-layer-norm (do_layer_norm_before=false, "
                                 f"OPT-350m) is not supported")
        if raw.get("word_embed_proj_dim", raw["hidden_size"]) != raw["hidden_size"]:
            raise ModelFileError(f"{path}: OPT with word_embed_proj_dim != hidden_size is not "
                                 f"supported")
        act = raw.get("activation_function", "relu")
        kind = ffn_kind or UNGATED_ACT_TO_KIND.get(act)
        ctx = int(need("max_position_embeddings"))
        cfg_kw = dict(
            n_kv_heads=int(need("num_attention_heads")), d_ff=int(need("ffn_dim")),
            norm="layer", norm_eps=1e-5, pos="learned", pos_offset=2, attn_bias=True,
            ffn_bias=bool(raw.get("enable_bias", True)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )
    else:
        act = raw.get("hidden_act", "silu")
        kind = ffn_kind or raw.get("sparseinfer_ffn_kind") or GATED_ACT_TO_KIND.get(act)
        rope = raw.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise ModelFileError(f"{path}: rope_scaling {rope!r} is not supported")
        params = raw.get("rope_parameters") or {}
        ctx = int(need("max_position_embeddings"))
        if raw.get("attention_bias") != raw.get("mlp_bias") and raw.get("mlp_bias"):
            raise ModelFileError(f"{path}: mlp_bias without attention_bias is not supported")
        cfg_kw = dict(
            n_kv_heads=int(raw.get("num_key_value_heads") or need("num_attention_heads")),
            d_ff=int(need("intermediate_size")), norm="rms",
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
            head_dim=int(raw.get("head_dim") or 0),
            attn_bias=bool(raw.get("attention_bias", False)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    if kind not in FFN_KINDS:
        raise ModelFileError(f"{path}: unsupported activation {act!r} for {arch_name}")
    try:
        cfg = ModelConfig(
            arch=family, vocab_size=int(need("vocab_size")), d_model=int(need("hidden_size")),
            n_layers=int(need("num_hidden_layers")), n_heads=int(need("num_attention_heads")),
            max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx, ffn_kind=kind,
            name=str(raw.get("_name_or_path") or path.name), **cfg_kw,
        )
    except ValueError as e:
        raise ModelFileError(f"{path}: inconsistent config.json: {e}") from None
    return cfg, names


def _need(raw: dict[str, Any], k: str, path: Path) -> Any:
    if k not in raw:
        raise ModelFileError(f"{path / 'config.json'}: missing key {k!r}")
    return raw[k]


def _load_hf(path: Path, dtype: torch.dtype, max_seq_len: int | None,
             ffn_kind: str | None) -> LoadedModel:
    from safetensors import safe_open

    from ..tokenizer import Tokenizer

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelFileError(f"{path}: expected a Hugging Face model directory with config.json, "
                             f"found none")
    raw = read_json(cfg_file, ModelFileError)
    cfg, names = hf_config(path, raw, max_seq_len, ffn_kind)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: expected *.safetensors weight files, found none")
    compiled = _compile(names)
    state: dict[str, torch.Tensor] = {}
    canon_to_src: dict[str, str] = {}
    infos = []
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    canon = map_name(name, compiled)
                    t = st.get_tensor(name)
                    infos.append(TensorInfo(name, str(t.dtype).replace("torch.", ""),
                                            tuple(t.shape), t.numel() * t.element_size()))
                    if canon is None:
                        log.warning("%s: ignoring unknown tensor %s", f, name)
                        continue
                    if canon == "pos_emb.weight" and max_seq_len:
                        t = t[: cfg.max_seq_len + cfg.pos_offset]
                    state[canon] = t.to(dtype)
                    canon_to_src[canon] = name
        except SparseInferError:
            raise
        except Exception as e:
            raise ModelFileError(f"{f}: cannot read safetensors file (truncated or corrupt?): "
                                 f"{e}") from None
    model = _build(cfg, state, dtype, path, canon_to_src, names)
    if not (path / "tokenizer.json").is_file():
        raise ModelFileError(f"{path}: expected tokenizer.json beside config.json, found none")
    tokenizer = Tokenizer.from_hf_dir(path)
    log.info("loaded %s: %s, %d layers, d_model %d, ffn %s", path, cfg.arch, cfg.n_layers,
             cfg.d_model, cfg.ffn_kind)
    return LoadedModel(model, tokenizer, path, "hf", raw, infos)
