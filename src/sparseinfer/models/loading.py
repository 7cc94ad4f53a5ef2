"""Open a model file (GGUF, or a Hugging Face directory with safetensors) without reading its
weights: the ``ModelConfig``, the metadata and an index of ``FileTensor`` handles that read one
tensor at a time from the memory-mapped file (gguf-py's memmap for GGUF, safetensors' own mmap).

``load_model`` (plan -> build on the meta device -> fill each tensor once) lives in
``models/build.py``; checkpoint names are data in ``models/names.py``. Every failure becomes one
``ModelFileError`` that names the file and what was expected and found.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import FFN_KINDS, ModelConfig
from ..errors import ModelFileError, SparseInferError
from ..fileio import drop_pages, read_json
from ..quant.blocks import BLOCK_BYTES, from_gguf
from .find import SPLIT_PART, find_model
from .names import (ARCH_FIELDS, EXPERT_STACKS, GATED_ACT_TO_KIND, GGUF_ARCH_FIELDS, GGUF_ARCHS,
                    GGUF_FFN_KIND, GGUF_ROPE_INTERLEAVED, GGUF_ROPE_THETA_LOCAL, GGUF_SPARSE_FFN_KINDS,
                    GGUF_NOPE_EVERY, GGUF_SWAPPED_NORMS, GGUF_WINDOW_PATTERN, HF_ARCHS,
                    HF_NORM_SHIFT, HF_QKV_GROUPED, UNGATED_ACT_TO_KIND, compile_names, map_name, source_name)

log = logging.getLogger(__name__)

__all__ = ["FileTensor", "ModelSource", "TensorInfo", "open_source", "load_model", "source_name",
           "unpermute_qk", "permute_qk"]


# ---- one tensor of the file ----------------------------------------------------------------------


@dataclass
class TensorInfo:
    name: str
    kind: str  # ggml type name or torch dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(eq=False)
class FileTensor:
    """A handle on one tensor of the file: its type, shape and bytes, read on demand."""

    name: str  # as the file names it
    kind: str  # ggml type name ("Q4_0", "F32", ...) or torch dtype name ("float32", ...)
    shape: tuple[int, ...]  # PyTorch orientation (rows first)
    nbytes: int
    canon: str | None = None  # our canonical name (None: not a model tensor)
    gguf: Any = None  # gguf ReaderTensor (memory-mapped)
    st: Any = None  # (safetensors handle, name)
    span: Any = None  # safetensors: (the file mapped, uint8; start, end of the tensor's bytes)

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.name, self.kind, self.shape, self.nbytes)

    @property
    def quantized(self) -> bool:
        return self.gguf is not None and self.kind not in ("F32", "F16", "BF16")

    def raw(self) -> np.ndarray:
        """GGUF: the bytes as stored (a read-only view of the mapped file; quantized types as
        uint8 ``[rows, bytes_per_row]``). safetensors' 16-bit floats: their bytes, a read-only
        view of the mapped file too (uint8 ``[rows, 2 · cols]``)."""
        if self.span is not None and self.kind in ("F16", "BF16"):
            mapped, start, end = self.span
            return mapped[start:end].reshape(self.shape[0], -1)
        if self.gguf is None:
            raise ValueError(f"tensor {self.name}: raw blocks exist for GGUF tensors and "
                             f"16-bit safetensors only")
        return self.gguf.data

    def float(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` (all by default) as a new float32 tensor."""
        stop = self.shape[0] if stop is None else stop
        if self.st is not None:
            handle, name = self.st
            sl = handle.get_slice(name)
            t = sl[start:stop] if len(self.shape) > 1 else sl[:]
            return t.float() if t.dtype != torch.float32 else t.clone()
        data = self.gguf.data
        rows = data.reshape(self.shape[0], -1)[start:stop] if len(self.shape) > 1 else data
        if self.kind == "F32":
            arr = np.array(rows, dtype=np.float32)  # copy: the map is read-only
        elif self.kind in ("F16", "BF16"):
            arr = _float16_rows(rows, self.kind)
        elif self.kind in BLOCK_BYTES and len(self.shape) == 2:  # Q4_0 / Q4_1, the same
            # values as gguf-py's in half the time
            return from_gguf(np.asarray(rows), self.kind, (stop - start, self.shape[1])).dequantize()
        else:
            from gguf import quants

            arr = quants.dequantize(np.asarray(rows), self.gguf.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(arr).reshape(stop - start, *self.shape[1:])
                                if len(self.shape) > 1 else np.ascontiguousarray(arr))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` as float32, read where the file is mapped (an embedding's lookup): a
        GGUF's quantized or 16-bit rows, or a safetensors file's 16-bit rows."""
        raw = np.asarray(self.raw())[ids]
        if self.kind in ("F16", "BF16"):
            return _float16_rows(raw, self.kind)
        from gguf import quants

        return quants.dequantize(raw, self.gguf.tensor_type)

    def release(self) -> None:
        """Drop this tensor's mapped pages from the process (they stay in the page cache)."""
        if self.gguf is not None:
            drop_pages(self.gguf.data)


def _float16_rows(raw, kind: str) -> np.ndarray:
    """F16 or BF16 values (a GGUF's 16-bit items, or a safetensors file's bytes) as float32;
    BF16 is a float32's top half: exact, without gguf-py's block loop."""
    bits = np.asarray(raw).view(np.uint16)
    if kind == "F16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---- the opened file -----------------------------------------------------------------------------


@dataclass
class ModelSource:
    """A model file opened for loading: config, metadata and tensor handles, no weights read."""

    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, FileTensor]  # canonical name -> handle (model tensors)
    extras: dict[str, FileTensor]  # file name -> handle (predictors, statistics, placement)
    names: dict[str, str]  # the checkpoint name map used (names.py)
    reader: Any = None  # GGUF: the gguf.GGUFReader
    all_tensors: list[FileTensor] = field(default_factory=list)  # in file order
    _handles: list[Any] = field(default_factory=list, repr=False)
    powerinfer: bool = False  # a file from PowerInfer's converter (magic b"PWRI")
    # GGUF: Q/K rows in llama.cpp's permuted order (rope over adjacent pairs)
    qk_permuted: bool = False
    norm_shift: float = 0.0  # added to every norm weight on load (HF Gemma's x * (1 + w))
    qkv_grouped: bool = False  # fused q/k/v rows grouped per kv head (HF Falcon): regrouped
    # what to call the model (the server's model id): the file's stem or directory's name, or
    # the Ollama / Hugging Face name it was found by (find.py)
    name: str = ""
    # GGUF split by llama.cpp's gguf-split: the parts after ``path`` (the first)
    parts: tuple[Path, ...] = ()

    @property
    def file_bytes(self) -> int:
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.glob("*.safetensors"))
        return sum(f.stat().st_size for f in (self.path, *self.parts))

    @property
    def infos(self) -> list[TensorInfo]:
        return [t.info for t in self.all_tensors]

    def extra_array(self, name: str) -> np.ndarray | None:
        """A non-model tensor (predictor, statistic, placement) as a numpy copy, or None."""
        t = self.extras.get(name)
        if t is None:
            return None
        if t.gguf is not None:
            return np.array(t.gguf.data)
        return t.float().numpy()

    def tokenizer(self):
        from ..tokenizer import Tokenizer

        if self.format == "hf":
            if not (self.path / "tokenizer.json").is_file():
                raise ModelFileError(f"{self.path}: expected tokenizer.json beside config.json, "
                                     f"found none")
            return Tokenizer.from_hf_dir(self.path)
        try:
            return Tokenizer.from_gguf(self.reader, self.path)
        except SparseInferError:
            raise
        except Exception as e:
            raise ModelFileError(f"{self.path}: cannot build the tokenizer from its metadata: "
                                 f"{e}") from None

    def missing(self, canon: str) -> ModelFileError:
        cfg = self.config
        return ModelFileError(f"{self.path}: missing tensor {source_name(canon, self.names) or canon!r} "
                              f"(expected for a {cfg.arch} model with {cfg.n_layers} layers)")


def open_source(path: str | Path, max_seq_len: int | None = None,
                ffn_kind: str | None = None) -> ModelSource:
    """Open a GGUF file or a Hugging Face directory (config.json + *.safetensors + tokenizer),
    or a model pulled with Ollama or cached by Hugging Face (``find.find_model``); reads
    metadata and the tensor index only. ``ffn_kind`` overrides the file's FFN kind."""
    found = find_model(path)
    path = found.path
    if path.is_dir():
        return _open_hf(path, max_seq_len, ffn_kind, found.name)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic in (b"GGUF", POWERINFER_MAGIC):
        return _open_gguf(path, max_seq_len, ffn_kind, found.name,
                          powerinfer=magic == POWERINFER_MAGIC)
    raise ModelFileError(
        f"{path}: not a model file: expected a GGUF file (magic b'GGUF' or PowerInfer's "
        f"b'PWRI') or a Hugging Face directory, found magic {magic!r}"
    )


def load_model(path: str | Path, dtype: str = "fp32", max_seq_len: int | None = None,
               ffn_kind: str | None = None):
    """A dense model (predictors ignored) with every weight in ``dtype`` (fp32 / bf16 / "auto":
    the file's own storage), its tokenizer and the opened source (``build.load`` takes every
    option: sparse layers, fused decode, device)."""
    from .build import load

    return load(path, dtype=dtype, max_seq_len=max_seq_len, ffn_kind=ffn_kind, dense=True)


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


POWERINFER_MAGIC = b"PWRI"  # PowerInfer's converter overwrites GGUF's magic; the rest is GGUF v3


@functools.lru_cache(maxsize=None)
def _reader_class():
    """gguf-py's reader, reading through a plain ndarray view of its memory map: the same
    bytes and results, without numpy's per-slice memmap bookkeeping, which made reading a
    tokenizer's 100,000 metadata strings take seconds. Files from PowerInfer's converter
    (magic b"PWRI") read their four magic bytes as GGUF's."""
    from gguf import GGUFReader
    from gguf.constants import GGUF_MAGIC, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class Reader(GGUFReader):
        powerinfer = False

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            if offset == 0 and self.powerinfer and count == 1 and dt == np.uint32:
                return np.array([GGUF_MAGIC], dtype=np.uint32)
            arr = plain[offset:offset + dt.itemsize * count].view(dtype=dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs, count):
            """gguf-py's loop, except that arrays of strings or scalars become one
            ``_ArrayField`` each (offsets found in one pass, parts made when asked for) instead
            of two numpy views per item: SmolLM2's 49,152 tokens and 48,900 merges took 0.5 s
            to open, most of a warm load. Byte-swapped files keep gguf-py's own loop."""
            if self.byte_order != "I":
                return super()._build_fields(offs, count)
            for _ in range(count):
                orig = offs
                klen, kdata = self._get_str(offs)
                offs += 8 + int(klen[0])
                raw_type = self._get(offs, np.uint32)
                offs += 4
                head = [klen, kdata, raw_type]
                name = str(bytes(kdata), encoding="utf-8")
                field = None
                if int(raw_type[0]) == int(GGUFValueType.ARRAY):
                    field, size = _array_field(self, orig, name, head, offs)
                if field is None:
                    size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                    field = ReaderField(orig, name, head + parts, [i + 3 for i in idxs], types)
                self._push_field(field, skip_sum=True)
                offs += size
            return offs

    return Reader


class _ArrayParts(Sequence):
    """The ``parts`` of an array field, made on demand: ``head`` (key length, key, type, item
    type, count) then, per item, its value (scalars) or its length and bytes (strings)."""

    def __init__(self, head: list, plain: np.ndarray, values: np.ndarray | None,
                 starts: np.ndarray | None):
        self.head, self.plain, self.values, self.starts = head, plain, values, starts

    def __len__(self) -> int:
        n = len(self.values) if self.values is not None else 2 * len(self.starts)
        return len(self.head) + n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        k = i - len(self.head)
        if k < 0:
            return self.head[i]
        if self.values is not None:
            return self.values[k:k + 1]
        start = int(self.starts[k // 2])
        n = int(self.plain[start:start + 8].view(np.uint64)[0])
        return (self.plain[start:start + 8].view(np.uint64) if k % 2 == 0
                else self.plain[start + 8:start + 8 + n])


@functools.lru_cache(maxsize=None)
def _array_field_class():
    from gguf.gguf_reader import ReaderField

    class ArrayField(ReaderField):
        """A gguf ``ReaderField`` whose ``parts`` is an ``_ArrayParts``."""

        __slots__ = ()
        contents = _array_field_contents

    return ArrayField


def _array_field(reader, orig: int, name: str, head: list, offs: int):
    """(``_ArrayField``, size in bytes from ``offs``) for a 1-D array of strings or scalars;
    (None, 0) for anything else (nested arrays go through gguf-py)."""
    from gguf.constants import GGUFValueType

    _ArrayField = _array_field_class()
    plain = reader.data.view(np.ndarray)
    raw_itype = reader._get(offs, np.uint32)
    alen = reader._get(offs + 4, np.uint64)
    itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
    start = offs + 12
    head = head + [raw_itype, alen]
    if itype == GGUFValueType.STRING:
        buf = plain.data  # one pass over (u64 length, bytes) items
        starts = np.empty(n, dtype=np.int64)
        unpack = struct.Struct("<Q").unpack_from
        pos = start
        for k in range(n):
            starts[k] = pos
            pos += 8 + unpack(buf, pos)[0]
        parts = _ArrayParts(head, plain, None, starts)
        field = _ArrayField(orig, name, parts, range(len(head) + 1, len(parts), 2),
                            [GGUFValueType.ARRAY, GGUFValueType.STRING])
        return field, pos - offs
    nptype = reader.gguf_scalar_to_np.get(itype)
    if nptype is None:
        return None, 0
    values = reader._get(start, nptype, n)
    parts = _ArrayParts(head, plain, values, None)
    field = _ArrayField(orig, name, parts, range(len(head), len(parts)),
                        [GGUFValueType.ARRAY, itype])
    return field, 12 + values.nbytes


def _array_field_contents(self, index_or_slice=slice(None)):
    """``ReaderField.contents`` without a numpy view per item."""
    parts = self.parts
    if parts.values is not None:
        out = parts.values[index_or_slice]
        return out.tolist() if isinstance(index_or_slice, slice) else out.item()
    buf = parts.plain.data
    u64 = struct.Struct("<Q").unpack_from

    def one(start: int) -> str:
        n = u64(buf, start)[0]
        return str(buf[start + 8:start + 8 + n], encoding="utf-8")

    if isinstance(index_or_slice, slice):
        return [one(int(st)) for st in parts.starts[index_or_slice].tolist()]
    return one(int(parts.starts[index_or_slice]))


def open_gguf(path: Path, powerinfer: bool = False):
    reader_cls = _reader_class()
    if powerinfer:
        reader_cls = type("PowerInferReader", (reader_cls,), {"powerinfer": True})
    try:
        return reader_cls(path, "r")
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


def gguf_file_tensor(t, canon: str | None = None) -> FileTensor:
    """A ``FileTensor`` for a gguf ReaderTensor."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return FileTensor(t.name, t.tensor_type.name, shape, int(t.n_bytes), canon, gguf=t)


def gguf_model_tensors(loaded) -> dict[str, Any]:
    """Canonical name -> ``gguf`` ReaderTensor (raw blocks, quantization as stored) for every
    model tensor of a loaded GGUF; empty for other formats."""
    return {c: t.gguf for c, t in loaded.source.tensors.items() if t.gguf is not None}


def gguf_tensor_to_torch(t) -> torch.Tensor:
    """Dequantize one ReaderTensor to a float32 torch tensor in row-major (PyTorch) shape."""
    return gguf_file_tensor(t).float()


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
    n_layers = int(key("block_count"))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelFileError(f"{path}: rope scaling {scaling!r} is not supported; expected none "
                             f"or Llama 3.1's rope_freqs.weight factors")
    head_dim = int(key("attention.key_length", d_model // n_heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise ModelFileError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count "
                             f"{rope_dims} of head size {head_dim}) are not supported")
    n_experts, used, d_ff, experts_norm = _gguf_experts(path, arch, meta, key)
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    windows: tuple[int, ...] = ()
    if window and window < ctx:
        every = GGUF_WINDOW_PATTERN.get(arch, 0)  # every n-th layer global (0: none)
        windows = tuple(0 if every and (i + 1) % every == 0 else window for i in range(n_layers))
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        d_ff=d_ff,
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx,
        head_dim=int(key("attention.key_length", d_model // n_heads)),
        n_experts=n_experts, n_experts_used=used, experts_norm=experts_norm,
        ffn_kind=kind,
        norm_eps=float(key("attention.layer_norm_rms_epsilon",
                           meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))),
        attn_bias="blk.0.attn_output.bias" in names,
        ffn_bias="blk.0.ffn_up.bias" in names,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_factors=_gguf_rope_factors(reader),
        attn_windows=windows,
        rope_theta_local=GGUF_ROPE_THETA_LOCAL.get(arch, 0.0) if windows else 0.0,
        nope_layers=tuple(i for i in range(n_layers) if GGUF_NOPE_EVERY.get(arch)
                          and (i + 1) % GGUF_NOPE_EVERY[arch] == 0),
        attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping") or 0.0),
        final_softcap=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
        # Granite's multipliers (llama.cpp's names)
        attn_scale=float(meta.get(f"{arch}.attention.scale") or 0.0),
        embedding_scale=float(meta.get(f"{arch}.embedding_scale") or 0.0),
        residual_scale=float(meta.get(f"{arch}.residual_scale") or 1.0),
        logit_scale=float(meta.get(f"{arch}.logit_scale") or 1.0),
        tie_embeddings="output.weight" not in names,
        name=str(meta.get("general.name", path.stem)),
        **{**ARCH_FIELDS[arch], **GGUF_ARCH_FIELDS.get(arch, {})},
    )


def _gguf_experts(path, arch, meta, key) -> tuple[int, int, int, bool]:
    """(experts, experts a token, FFN width, renormalized top-k weights) from llama.cpp's
    ``{arch}.expert_*`` keys; (0, 0, feed_forward_length, True) for a dense model. Only what
    Mixtral and Qwen3-MoE use: softmax routing, no shared experts, no weight scale."""
    n = int(meta.get(f"{arch}.expert_count") or 0)
    if not n:
        return 0, 0, int(key("feed_forward_length")), True
    shared = int(meta.get(f"{arch}.expert_shared_count") or 0)
    gating = int(meta.get(f"{arch}.expert_gating_func") or 1)  # llama.cpp: 1 softmax, 2 sigmoid
    scale = float(meta.get(f"{arch}.expert_weights_scale") or 1.0)
    if shared or gating != 1 or scale != 1.0:
        raise ModelFileError(f"{path}: mixture of experts with {shared} shared experts, gating "
                             f"function {gating}, weights scale {scale} is not supported; "
                             f"expected Mixtral's / Qwen3-MoE's (no shared experts, softmax "
                             f"gating (1), scale 1)")
    d_ff = int(meta.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length"))
    return (n, int(key("expert_used_count")), d_ff,
            bool(meta.get(f"{arch}.expert_weights_norm", True)))


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's matrix of a GGUF tensor that stacks every expert's ([experts, rows, cols]),
    standing in for gguf-py's ReaderTensor: its bytes are a view of the mapped file."""

    name: str
    tensor_type: Any
    data: np.ndarray
    n_bytes: int
    data_offset: int


def _expert_tensors(tensors: dict[str, FileTensor]) -> dict[str, FileTensor]:
    """``tensors`` with each stacked experts tensor (``names.EXPERT_STACKS``) replaced by one
    2-D tensor per expert, views of its bytes: the projections of expert e are then named and
    planned as a dense FFN's are (``layers.{i}.ffn.experts.{e}.gate.weight`` ...)."""
    out = {}
    for canon, t in tensors.items():
        layer, _, leaf = canon.rpartition(".weight")[0].partition(".ffn.")
        each = EXPERT_STACKS.get("ffn." + leaf) if layer else None
        if each is None or t.gguf is None:
            out[canon] = t
            continue
        if len(t.shape) != 3:
            raise ModelFileError(f"tensor {t.name!r}: expected [experts, rows, cols], found shape "
                                 f"{t.shape}")
        n, per = t.shape[0], t.nbytes // t.shape[0]
        for e in range(n):
            name = f"{layer}.{each.format(e=e)}.weight"
            g = ExpertSlice(f"{t.name}[{e}]", t.gguf.tensor_type, t.gguf.data[e], per,
                            int(t.gguf.data_offset) + e * per)
            out[name] = FileTensor(g.name, t.kind, t.shape[1:], per, name, gguf=g)
    return out


def _gguf_rope_factors(reader) -> tuple[float, ...]:
    """llama.cpp's ``rope_freqs.weight`` (Llama 3.1 rope scaling): one divisor per pair."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(f) for f in gguf_file_tensor(t).float().tolist())
    return ()




def _gguf_opt_config(path, arch, meta, names, kind, max_seq_len, key, reader) -> ModelConfig:
    """ModelConfig of an OPT GGUF from its ``opt.*`` keys (PowerInfer's converter writes them):
    LayerNorm, learned positions with OPT's two extra rows, biased attention and ReLU MLP."""
    n_heads = int(key("attention.head_count"))
    pos = next((t for t in reader.tensors if t.name == "position_embd.weight"), None)
    if pos is None:
        raise ModelFileError(f"{path}: missing tensor 'position_embd.weight' (expected for an "
                             f"opt model)")
    ctx = int(pos.shape[-1]) - 2  # OPT's position table has 2 rows in front
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        arch="opt", vocab_size=int(vocab), d_model=int(key("embedding_length")),
        n_layers=int(key("block_count")), n_heads=n_heads, n_kv_heads=n_heads,
        d_ff=int(key("feed_forward_length")),
        max_seq_len=min(ctx, max_seq_len) if max_seq_len else ctx, ffn_kind=kind, norm="layer",
        norm_eps=float(key("attention.layer_norm_epsilon", 1e-5)), pos="learned", pos_offset=2,
        attn_bias="blk.0.attn_q.bias" in names, ffn_bias="blk.0.ffn_up.bias" in names,
        tie_embeddings="output.weight" not in names, name=str(meta.get("general.name", path.stem)),
    )


# how a GGUF architecture's hyper-parameters are read (default: llama.cpp's llama-style keys)
GGUF_CONFIG_READERS = {"opt": _gguf_opt_config}


def _open_gguf(path: Path, max_seq_len: int | None, ffn_kind: str | None, model_name: str,
               powerinfer: bool = False) -> ModelSource:
    reader = open_gguf(path, powerinfer)
    meta = read_gguf_metadata(reader)
    parts = [(path, reader)]
    if int(meta.get("split.count") or 1) > 1:
        parts, meta = _split_parts(path, reader, meta, powerinfer)
        path, reader = parts[0][0], SplitReader(parts)
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
        # PowerInfer's sparse GGUFs (predictors present) are ReLU-family models
        kind = (GGUF_SPARSE_FFN_KINDS.get(arch, "reglu") if "blk.0.fc1.weight" in names
                else GGUF_FFN_KIND.get(arch, "swiglu"))
    try:
        if "sparseinfer.config" in meta:  # written by our exporter: the whole ModelConfig
            fields = json.loads(meta["sparseinfer.config"])
            fields["ffn_kind"] = kind
            if max_seq_len:
                fields["max_seq_len"] = min(fields["max_seq_len"], max_seq_len)
            cfg = ModelConfig(**fields)
        else:
            read_cfg = GGUF_CONFIG_READERS.get(arch, _gguf_llama_config)
            cfg = read_cfg(path, arch, meta, names, kind, max_seq_len, key, reader)
    except (ValueError, TypeError) as e:
        raise ModelFileError(f"{path}: inconsistent hyper-parameters: {e}") from None
    # llama.cpp's converter permutes Q/K rows of some architectures for rope over adjacent
    # pairs: use them as stored. PowerInfer's converter writes them in the checkpoint's order:
    # rotate-half, as the source model (PowerInfer's own runtime applies adjacent-pair rope to
    # them; README).
    permuted = cfg.pos == "rope" and GGUF_ROPE_INTERLEAVED[arch] and not powerinfer
    cfg = replace(cfg, rope_interleaved=permuted)
    compiled = compile_names(GGUF_ARCHS[arch])
    tensors, extras, every = {}, {}, []
    for part, r in parts:
        size = part.stat().st_size
        for t in r.tensors:
            _check_in_file(part, size, t)
    for t in reader.tensors:
        canon = map_name(t.name, compiled)
        ft = gguf_file_tensor(t, canon)
        every.append(ft)
        if canon is None:
            extras[t.name] = ft
        else:
            tensors[canon] = ft
    if arch in GGUF_SWAPPED_NORMS and "layers.0.ffn_norm.weight" in tensors:
        swap = {"attn_norm": "ffn_norm", "ffn_norm": "attn_norm"}
        tensors = {_swap_norm(c, swap): t for c, t in tensors.items()}
        for t in tensors.values():
            t.canon = _swap_norm(t.canon, swap)
    if cfg.n_experts:
        tensors = _expert_tensors(tensors)
    cfg = _with_shared_norm(cfg, tensors)
    return ModelSource(path, "gguf", cfg, meta, tensors, extras, GGUF_ARCHS[arch], reader, every,
                       qk_permuted=permuted, powerinfer=powerinfer, name=model_name,
                       parts=tuple(part for part, _ in parts[1:]))


def _check_in_file(path: Path, size: int, t) -> None:
    if int(t.data_offset) + int(t.n_bytes) > size:
        raise ModelFileError(f"{path}: tensor {t.name!r} ends at byte "
                             f"{int(t.data_offset) + int(t.n_bytes)} but the file has {size} "
                             f"(truncated or corrupt file?)")


class SplitReader:
    """The parts of a model split by llama.cpp's gguf-split, read as one file: the first part's
    metadata and every part's tensors in order, each still mapped from its own part."""

    def __init__(self, parts: list[tuple[Path, Any]]):
        self.fields = parts[0][1].fields
        self.tensors = [t for _, r in parts for t in r.tensors]


def _split_parts(path: Path, reader, meta: dict[str, Any], powerinfer: bool
                 ) -> tuple[list[tuple[Path, Any]], dict[str, Any]]:
    """Every part of a split model, opened, whichever part ``path`` (opened as ``reader``, with
    metadata ``meta``) names, and the first part's metadata; checked against the ``split.*``
    keys (count, each part's number, the tensors in all)."""
    count = int(meta["split.count"])
    m = SPLIT_PART.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ModelFileError(
            f"{path}: part {int(meta.get('split.no') or 0) + 1} of a model split into {count} "
            f"files (llama.cpp's gguf-split), but its name does not say where the others are: "
            f"expected a name like MODEL-00001-of-{count:05d}.gguf, or merge the parts with "
            f"`llama-gguf-split --merge FIRST-PART.gguf OUT.gguf`")
    names = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [p.name for p in names if not p.is_file()]
    if missing:
        raise ModelFileError(f"{path}: part of a model split into {count} files; expected all "
                             f"of them in {path.parent}, missing {', '.join(missing)}")
    parts = []
    for i, p in enumerate(names):
        r = reader if p == path else open_gguf(p, powerinfer)
        found = {k: _field_value(r.fields[k]) for k in ("split.no", "split.count")
                 if k in r.fields}
        if found != {"split.no": i, "split.count": count}:
            raise ModelFileError(f"{p}: expected part {i + 1} of {count} (split.no {i}, "
                                 f"split.count {count}), found {found or 'no split keys'}")
        parts.append((p, r))
    first = meta if names[0] == path else read_gguf_metadata(parts[0][1])
    total = sum(len(r.tensors) for _, r in parts)
    if int(first.get("split.tensors.count", total)) != total:
        raise ModelFileError(f"{names[0]}: split.tensors.count says {first['split.tensors.count']} "
                             f"tensors, its {count} parts hold {total}")
    log.info("%s: a model split into %d files, read as one", names[0], count)
    return parts, first


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
        pre = bool(raw.get("do_layer_norm_before", True))
        emb = int(raw.get("word_embed_proj_dim") or need("hidden_size"))
        act = raw.get("activation_function", "relu")
        kind = ffn_kind or UNGATED_ACT_TO_KIND.get(act)
        ctx = int(need("max_position_embeddings"))
        cfg_kw = dict(
            n_kv_heads=int(need("num_attention_heads")), d_ff=int(need("ffn_dim")),
            norm="layer", norm_eps=1e-5, pos="learned", pos_offset=2, attn_bias=True,
            ffn_bias=bool(raw.get("enable_bias", True)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
            # OPT-350m: norms after the residual adds, none before the head, and embeddings of
            # word_embed_proj_dim projected in and out
            post_norm=not pre, final_norm=pre and not raw.get("_remove_final_layer_norm"),
            emb_dim=emb if emb != int(need("hidden_size")) else 0,
        )
    elif family == "falcon":
        if raw.get("alibi"):
            raise ModelFileError(f"{path}: Falcon with ALiBi positions (alibi=true) is not "
                                 f"supported; expected rotary embeddings")
        act = raw.get("activation", "gelu")
        kind = ffn_kind or UNGATED_ACT_TO_KIND.get(act)
        ctx = int(raw.get("max_position_embeddings") or 2048)
        new_arch = bool(raw.get("new_decoder_architecture"))
        n_heads = int(need("num_attention_heads"))
        bias = bool(raw.get("bias", False))
        params = raw.get("rope_parameters") or {}
        cfg_kw = dict(
            n_kv_heads=int(raw.get("num_kv_heads") or n_heads)
            if new_arch or not raw.get("multi_query", True) else 1,
            d_ff=int(raw.get("ffn_hidden_size") or 4 * int(need("hidden_size"))),
            norm="layer", norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
            attn_bias=bias, ffn_bias=bias, parallel=bool(raw.get("parallel_attn", True))
            or new_arch, tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )
    else:
        act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")  # Gemma: the former
        kind = ffn_kind or raw.get("sparseinfer_ffn_kind") or GATED_ACT_TO_KIND.get(act)
        params = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
        # per layer type (Gemma 3): the global layers' parameters, the windowed layers' base
        local = params.get("sliding_attention") or {}
        params = params.get("full_attention", params)
        theta_local = float(local.get("rope_theta", raw.get("rope_local_base_freq") or 0.0))
        windows = _hf_windows(raw, int(need("num_hidden_layers")))
        q_scalar = raw.get("query_pre_attn_scalar")
        partial = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
                        or 1.0)
        if partial != 1.0:
            raise ModelFileError(f"{path / 'config.json'}: partial rotary embeddings "
                                 f"(partial_rotary_factor {partial}) are not supported; "
                                 f"expected 1.0")
        ctx = int(need("max_position_embeddings"))
        if raw.get("mlp_bias"):
            raise ModelFileError(f"{path}: mlp_bias=true (biased gated MLP) is not supported")
        head_dim = int(raw.get("head_dim") or 0) or int(need("hidden_size")) // int(
            need("num_attention_heads"))
        # mixtures of experts (Mixtral: num_local_experts; Qwen3-MoE: num_experts and each
        # expert moe_intermediate_size wide, every layer sparse)
        n_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        if n_experts and (raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step")
                                                               or 1) != 1):
            raise ModelFileError(f"{path / 'config.json'}: dense layers among the experts' "
                                 f"(mlp_only_layers {raw.get('mlp_only_layers')}, "
                                 f"decoder_sparse_step {raw.get('decoder_sparse_step')}) are not "
                                 f"supported; expected experts in every layer")
        cfg_kw = dict(
            n_kv_heads=int(raw.get("num_key_value_heads") or need("num_attention_heads")),
            d_ff=int(raw.get("moe_intermediate_size") or need("intermediate_size"))
            if n_experts else int(need("intermediate_size")), norm="rms",
            n_experts=n_experts,
            n_experts_used=int(need("num_experts_per_tok")) if n_experts else 0,
            experts_norm=bool(raw.get("norm_topk_prob", True)),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
            head_dim=head_dim,
            rope_factors=_hf_rope_factors(path, params, head_dim),
            attn_windows=windows,
            rope_theta_local=theta_local if any(windows) else 0.0,
            # SmolLM3: no_rope_layers holds 1 where a layer uses rope, 0 where it has none
            nope_layers=tuple(i for i, use in enumerate(raw.get("no_rope_layers") or ())
                              if not use),
            attn_scale=float(q_scalar) ** -0.5 if q_scalar
            else float(raw.get("attention_multiplier") or 0.0),  # Granite
            embedding_scale=float(raw.get("embedding_multiplier") or 0.0),
            residual_scale=float(raw.get("residual_multiplier") or 1.0),
            logit_scale=float(raw.get("logits_scaling") or 1.0),
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            attn_bias=bool(raw.get("attention_bias") or False),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **ARCH_FIELDS[family],
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


def _hf_rope_factors(path: Path, params: dict[str, Any], head_dim: int) -> tuple[float, ...]:
    """Per-pair frequency divisors for ``rope_type`` llama3 (Llama 3.1/3.2), computed as
    transformers' ``_compute_llama3_parameters`` and llama.cpp's converter do; () for default."""
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return ()
    if kind == "linear":  # positions divided by the factor (Gemma 3 4B+)
        return (float(params["factor"]),) * (head_dim // 2)
    if kind != "llama3":
        raise ModelFileError(f"{path / 'config.json'}: rope scaling {kind!r} is not supported; "
                             f"expected 'default', 'linear' or 'llama3'")
    theta = float(params.get("rope_theta", 10000.0))
    factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor",
                                                    "high_freq_factor"))
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def _hf_windows(raw: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """Per-layer attention windows: ``layer_types`` names the sliding layers when present
    (Qwen2/3, Gemma), else ``sliding_window`` applies to every layer (Mistral)."""
    window = int(raw.get("sliding_window") or 0)
    if raw.get("use_sliding_window") is False:  # Qwen2/3 configs carry an unused window
        return ()
    if not window or window >= int(raw.get("max_position_embeddings") or 0) > 0:
        return ()
    types = raw.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * n_layers


def _need(raw: dict[str, Any], k: str, path: Path) -> Any:
    if k not in raw:
        raise ModelFileError(f"{path / 'config.json'}: missing key {k!r}")
    return raw[k]




def _open_hf(path: Path, max_seq_len: int | None, ffn_kind: str | None,
             model_name: str) -> ModelSource:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelFileError(f"{path}: expected a Hugging Face model directory with config.json, "
                             f"found none")
    raw = read_json(cfg_file, ModelFileError)
    cfg, names = hf_config(path, raw, max_seq_len, ffn_kind)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: expected *.safetensors weight files, found none")
    compiled = compile_names(names)
    tensors, extras, every, handles = {}, {}, [], []
    for f in files:
        try:
            st = safe_open(f, framework="pt")
            handles.append(st)
            mapped, spans = _safetensors_spans(f)
            for name in st.keys():
                sl = st.get_slice(name)
                shape = tuple(int(n) for n in sl.get_shape())
                dtype = sl.get_dtype()
                elt = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1}.get(dtype, 4)
                canon = map_name(name, compiled)
                ft = FileTensor(name, dtype, shape, int(np.prod(shape)) * elt, canon,
                                st=(st, name), span=(mapped, *spans[name]))
                every.append(ft)
                if canon is None:
                    if not name.startswith("blk."):  # predictors/statistics are expected extras
                        log.warning("%s: ignoring unknown tensor %s", f, name)
                    extras[name] = ft
                else:
                    tensors[canon] = ft
        except SparseInferError:
            raise
        except Exception as e:
            raise ModelFileError(f"{f}: cannot read safetensors file (truncated or corrupt?): "
                                 f"{e}") from None
    cfg = _with_shared_norm(cfg, tensors)
    return ModelSource(path, "hf", cfg, raw, tensors, extras, names, None, every, handles,
                       norm_shift=HF_NORM_SHIFT.get(cfg.arch, 0.0),
                       qkv_grouped=cfg.arch in HF_QKV_GROUPED, name=model_name)


def _safetensors_spans(f: Path) -> tuple[np.memmap, dict[str, tuple[int, int]]]:
    """``f`` mapped read-only, and where each tensor's bytes are in it (the format: an 8-byte
    little-endian header length, the JSON header whose ``data_offsets`` count from its end).
    safetensors' own API gives copies, and none of bfloat16 in numpy."""
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    base = 8 + n
    spans = {k: (base + int(v["data_offsets"][0]), base + int(v["data_offsets"][1]))
             for k, v in header.items() if k != "__metadata__"}
    return np.memmap(f, dtype=np.uint8, mode="r"), spans


def _swap_norm(canon: str, swap: dict[str, str]) -> str:
    parts = canon.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in swap:
        parts[2] = swap[parts[2]]
    return ".".join(parts)


def _with_shared_norm(cfg: ModelConfig, tensors: dict[str, Any]) -> ModelConfig:
    """Parallel blocks without an FFN norm of their own feed the attention's norm to the FFN."""
    return replace(cfg, shared_norm=cfg.parallel and "layers.0.ffn_norm.weight" not in tensors)
