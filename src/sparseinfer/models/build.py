"""Build a model from its load plan and fill it from the mapped file, once.

    open_source(path)              metadata + tensor index (loading.py; no weight bytes read)
    -> make_plan(source, ...)      every weight's storage, checked against free memory (plan.py)
    -> Transformer(cfg, PlannedModules(plan)) on the meta device
    -> fill(model, source, plan)   each module reads its tensors from the map into its final
                                   layout (4-bit blocks, int8, float, bundled sparse rows); at most
                                   one fused weight passes through float32 at a time, and the
                                   file pages it read are dropped from the process afterwards

Nothing rewrites the model after this: ``print(model)`` is what runs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..cpu import loads as cpu_loads
from ..cpu.panels import FILE_TYPES, PANEL, PANEL_TYPES, panel_type, to_panels
from ..errors import ModelFileError, SparseInferError
from ..fileio import release_heap
from ..quant import blocks as qb
from ..quant.linear import FloatLinear, GGMLLinear, Int4Linear, Int8Linear
from ..sparse.ffn import DenseCopy, SparseFFN
from ..sparse.packed import DTYPES as PACKED_DTYPES
from ..sparse.packed import (Q4_BYTES, Q4_GROUP, PackedFFN, empty_hugepages, int8_block,
                             q4i8_empty, quantize_int8, quantize_q4_rows)
from ..threads import kernel_threads
from .loading import FileTensor, ModelSource, open_source, unpermute_qk
from .model import Norm, Transformer
from .plan import Plan, make_plan

log = logging.getLogger(__name__)

FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- modules the plan asks for --------------------------------------------------------------------


class FileEmbedding(nn.Module):
    """Token embeddings left in the mapped file in their own type (a GGUF's quantized or 16-bit
    rows, a safetensors file's 16-bit rows); the rows of the tokens looked up are made float on
    the way out (one row per decoded token)."""

    def __init__(self, n: int, d: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = n, d, dtype
        self.tensor: FileTensor | None = None

    def fill(self, tensor: FileTensor) -> None:
        self.tensor = tensor

    def extra_repr(self) -> str:
        kind = self.tensor.kind if self.tensor is not None else "?"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} rows from the mapped file"

    @property
    def weight(self) -> torch.Tensor:
        """All rows as float (a full copy: for export and tests, not for decoding)."""
        return self.tensor.float().to(self.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.tensor.rows(tokens.reshape(-1).cpu().numpy())
        out = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(self.dtype)
        return out.view(*tokens.shape, self.embedding_dim).to(tokens.device)


class PlannedModules:
    """The ``modules`` factory ``Transformer`` builds from: each weight as its plan says."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.fused = plan.fused_decode
        self.float = FLOAT[plan.float_dtype]

    def linear(self, path: str, n_in: int, n_out: int, bias: bool) -> nn.Module:
        storage = self.plan.weight(path).storage
        if storage == "ggml":
            return GGMLLinear(n_in, n_out, bias)
        if storage == "q4":
            return Int4Linear(n_in, n_out, bias)
        if storage == "int8":
            return Int8Linear(n_in, n_out, bias)
        return FloatLinear(n_in, n_out, bias, FLOAT[storage])

    def embedding(self, path: str, n: int, d: int) -> nn.Module:
        if self.plan.weight(path).storage == "file":
            return FileEmbedding(n, d, self.float)
        return nn.Embedding(n, d, dtype=self.float)

    def ffn(self, layer: int, cfg: ModelConfig) -> nn.Module | None:
        sp = self.plan.sparse
        if sp is None:
            return None
        from ..sparse.runtime import make_selector

        # the selector is decided here; a predictor's weights come in ``fill``
        if sp.disk is not None:  # cold neurons in the file (sparseinfer.disk)
            from ..disk.tier import DiskFFN

            fast = sp.disk.fast_counts[layer] if sp.disk.fast_counts else 0
            return DiskFFN(cfg.ffn_kind, cfg.d_model, cfg.d_ff, make_selector(sp, layer),
                           sp.disk.ram_counts[layer], sp.disk.options.prefetch, n_fast=fast,
                           fast_device=sp.device)
        return SparseFFN(cfg.ffn_kind, cfg.d_model, cfg.d_ff, make_selector(sp, layer),
                         sp.hot_counts[layer], sp.device, sp.split_tiers)


# ---- reading one planned weight -------------------------------------------------------------------


@dataclass
class WeightSource:
    """The file tensors of one planned weight, fused in order, as the module wants them."""

    src: ModelSource
    names: tuple[str, ...]  # canonical tensor names

    def _qk_heads(self, canon: str) -> int | None:
        cfg = self.src.config
        if not self.src.qk_permuted or cfg.rope_interleaved:
            return None  # llama.cpp's Q/K row order, un-permuted unless rope is interleaved
        if ".attn.wq." in canon:
            return cfg.n_heads
        if ".attn.wk." in canon:
            return cfg.n_kv_heads
        return None

    def _one(self, canon: str) -> torch.Tensor:
        t = self.src.tensors[canon]
        w = t.float()
        t.release()
        if self.src.qkv_grouped and ".attn.wqkv." in canon:
            w = _ungroup_qkv(w, self.src.config)
        if canon.endswith("down_t.weight"):
            w = w.t().contiguous()
        heads = self._qk_heads(canon)
        return unpermute_qk(w, heads) if heads else w

    def float(self) -> torch.Tensor:
        parts = [self._one(n) for n in self.names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows of a single, unpermuted source (chunked quantization of large heads)."""
        (canon,) = self.names
        t = self.src.tensors[canon]
        w = t.float(start, stop)
        if stop >= t.shape[0]:
            t.release()
        return w

    def blocks(self) -> qb.Q4Blocks:
        """The file's own 4-bit blocks (Q4_0 / Q4_1 / Q4_K), fused, Q/K rows un-permuted."""
        parts = []
        for canon in self.names:
            t = self.src.tensors[canon]
            b = qb.from_gguf(np.asarray(t.raw()), t.kind, t.shape)
            t.release()
            heads = self._qk_heads(canon)
            if heads:
                b = b.rows(unpermute_qk(torch.arange(t.shape[0]), heads))
            parts.append(b)
        return parts[0] if len(parts) == 1 else qb.Q4Blocks.cat(parts)

    def ggml_parts(self, panels: bool = True) -> list[tuple[str, np.ndarray, int]]:
        """(type, bytes, rows) of each source: views of the mapped file as stored, except Q/K
        rows that llama.cpp permuted, copied back into rotate-half order, and (``panels``)
        matrices of whole panels of a type with a panel layout (``cpu.panels.PANEL_TYPES``),
        rearranged into panels of 16 rows (the C kernels' fastest layout for several input
        rows, and as fast for one; the one the active ISA reads fastest, ``cpu.panels.
        panel_type``). A copy's mapped pages are released."""
        parts = []
        for canon in self.names:
            t = self.src.tensors[canon]
            kind, rows = t.kind, t.shape[0]
            raw = np.asarray(t.raw()).view(np.uint8).reshape(rows, -1)  # (F16: float16 items)
            heads = self._qk_heads(canon)
            if heads:
                raw = np.ascontiguousarray(raw[unpermute_qk(torch.arange(rows), heads).numpy()])
            ptype = None
            if panels and kind in PANEL_TYPES:
                from ..cpu.ops import get_isa  # (the library: the panels are its layouts)

                ptype = panel_type(kind, get_isa())
            if ptype and rows % PANEL == 0:
                raw = to_panels(raw, kind, rows, t.shape[1], ptype)
                kind = ptype
            if heads or kind in FILE_TYPES:  # a copy: the file's pages are not needed
                t.release()
            parts.append((kind, raw, rows))
        return parts

    def bias(self) -> torch.Tensor | None:
        names = [_bias_name(self.src, n) for n in self.names]
        for n in names:
            if n not in self.src.tensors:
                raise self.src.missing(n)
        return WeightSource(self.src, tuple(names)).float()


def _bias_name(src: ModelSource, weight: str) -> str:
    """The bias of a canonical weight name; a transposed down projection's bias may be stored
    under either name (PowerInfer writes ``ffn_down_t.bias``)."""
    base = weight[: -len("weight")]
    for name in (base + "bias", base.replace("down_t.", "down.") + "bias",
                 base.replace("down.", "down_t.") + "bias"):
        if name in src.tensors:
            return name
    return base.replace("down_t.", "down.") + "bias"


def _ungroup_qkv(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Rows grouped per kv head ([q heads of the group, k, v] per group: HF Falcon) -> all q
    heads, then k, then v (as llama.cpp's Falcon converter does)."""
    nkv, hd = cfg.n_kv_heads, cfg.head_dim
    g = w.reshape(nkv, cfg.n_heads // nkv + 2, hd, *w.shape[1:])
    return torch.cat([g[:, :-2].reshape(-1, *w.shape[1:]), g[:, -2].reshape(-1, *w.shape[1:]),
                      g[:, -1].reshape(-1, *w.shape[1:])])


def _fill_linear(module: nn.Module, ws: WeightSource, origin: str, shape, panels: bool) -> None:
    bias = ws.bias() if getattr(module, "bias", None) is not None else None
    if isinstance(module, GGMLLinear):
        module.fill(ws.ggml_parts(panels), bias)
    elif isinstance(module, Int4Linear):
        blocks = ws.blocks() if origin == "file blocks" else qb.quantize(ws.float())
        module.fill(blocks, bias)
    elif isinstance(module, Int8Linear):
        if len(ws.names) == 1 and not ws._qk_heads(ws.names[0]) and not ws.src.qkv_grouped \
                and not ws.names[0].endswith("down_t.weight"):
            module.fill(ws.rows, bias)
        else:
            w = ws.float()
            module.fill(lambda a, b: w[a:b], bias)
    else:
        w = ws.float()
        if tuple(w.shape) != tuple(shape):
            raise ModelFileError(f"{ws.src.path}: tensor {ws.src.tensors[ws.names[0]].name!r}: "
                                 f"expected shape {tuple(shape)}, found {tuple(w.shape)}")
        module.fill(w, bias)


def _packed_ffn(src: ModelSource, names: tuple[str, ...], kind: str, dtype: str,
                up_bias: torch.Tensor | None, q4_gates: bool = False,
                q4_ups: bool = False) -> PackedFFN:
    """Bundle one layer's gate/up/down rows (down from ``down_t`` or transposed from ``down``),
    one matrix at a time, straight into the rows' storage; ``q4_gates`` (``plan.q4_gates_apart``:
    the gate a Q4_0 tensor) keeps the gate rows apart as q4 rows, the file's numbers, and the
    bundles hold the up and down rows; ``q4_ups`` (``plan.q4_ups_apart``) the up rows as q4
    rows too, in bundles of dtype "q4i8" with the int8 down rows."""
    cfg = src.config
    D, F = cfg.d_model, cfg.d_ff
    # (tensor, its rows for this matrix): a fused w_in (Phi-3) gives the gate rows, then up's
    mats = [(c, h) for c in names
            for h in ((slice(0, F), slice(F, 2 * F)) if c.endswith("ffn.w_in.weight") else (None,))]
    gates = bundles = None
    block = int8_block(D) if dtype == "int8" else 0

    def q4_apart(canon: str, what: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The file's Q4_0 rows of ``canon`` as q4 rows (into ``out``: rows a stride apart)."""
        from ..cpu.ops import bundle_rows  # (the C library: loaded only where it is needed)

        t = src.tensors[canon]
        if t.kind != "Q4_0" or tuple(t.shape) != (F, D):
            raise ModelFileError(f"{src.path}: tensor {t.name!r}: expected Q4_0 {(F, D)} {what} "
                                 f"rows to keep apart, found {t.kind} {tuple(t.shape)}")
        rows = empty_hugepages((F, D // Q4_GROUP * Q4_BYTES), torch.uint8) if out is None else out
        bundle_rows(np.asarray(t.raw()).reshape(F, -1), "Q4_0", F, D, False, rows)
        t.release()
        return rows

    if q4_gates:
        gates = q4_apart(names[0], "gate")
        mats = mats[1:]
    if q4_ups:  # "q4i8" bundles, written in place: the up rows, then the int8 down rows below
        bundles, ups, down_rows, down_scales = q4i8_empty(F, D, block)
        q4_apart(names[1], "up", ups)
        mats = mats[1:]
        rows, scales = down_rows.unsqueeze(1), down_scales.unsqueeze(1)
    else:
        width = D // Q4_GROUP * Q4_BYTES if dtype == "q4" else D
        rows = empty_hugepages((F, len(mats), width), PACKED_DTYPES[dtype])
        scales = torch.empty(F, len(mats), D // block) if dtype == "int8" else None
    for m, (canon, half) in enumerate(mats):
        t = src.tensors[canon]
        down = canon.endswith("ffn.down.weight")
        stored = (D, F) if down else (F if half is None else 2 * F, D)
        if (t.kind in ("Q4_0", "F16") and tuple(t.shape) == stored and D % Q4_GROUP == 0
                and (dtype == "q4" or (dtype == "int8" and block == Q4_GROUP)) and cpu_loads()):
            # rows made from the file's Q4_0 or F16 weights in C (a down matrix's columns, a
            # converted file's F16 down_t rows), as the torch quantizers below would from the
            # float weights, without that float copy; Q4_0 rows into q4 rows keep the file's
            # numbers (moved into the rows' layout, never rounded twice)
            from ..cpu.ops import bundle_rows

            raw = np.asarray(t.raw()).reshape(stored[0], -1)
            if half is not None:
                raw = raw[half]
            bundle_rows(raw, t.kind, *((D, F) if down else (F, D)), down, rows[:, m],
                        scales[:, m] if dtype == "int8" else None)
            if half is None or half.start:
                t.release()
            continue
        w = t.float()
        if half is None or half.start:
            t.release()
        if half is not None:
            w = w[half]
        if canon.endswith("ffn.down.weight"):
            w = w.t()  # [d_ff, d_model]
        if tuple(w.shape) != (F, D):
            raise ModelFileError(f"{src.path}: tensor {t.name!r}: expected shape {(F, D)} as "
                                 f"neuron rows, found {tuple(w.shape)}")
        if dtype == "int8":
            rows[:, m], scales[:, m] = quantize_int8(w, block)
        elif dtype == "q4":
            rows[:, m] = quantize_q4_rows(w)
        else:
            rows[:, m] = w
        del w
    if bundles is not None:
        return PackedFFN(kind, "q4i8", D, F, bundles, None, block, up_bias, gates)
    return PackedFFN(kind, dtype, D, F, rows, scales, block, up_bias, gates)


def _dense_copy(src: ModelSource, names: tuple[str, ...], up_bias: torch.Tensor | None,
                gated: bool) -> DenseCopy:
    """One layer's FFN as a dense model's ``GGMLLinear`` modules (``SparsePlan.batch_dense``): the
    file's gate/up blocks and a ``down`` tensor's (``WeightSource.ggml_parts``: panels of 16
    rows), a ``down_t`` tensor (a converted file's neuron rows) transposed into Q8_0 blocks
    (gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    cfg = src.config
    D, F = cfg.d_model, cfg.d_ff
    ins, down = names[:-1], names[-1]
    bias = None
    if up_bias is not None:
        bias = torch.cat([torch.zeros(F), up_bias.float()]) if gated else up_bias.float()
    w_in = GGMLLinear(D, (2 if gated else 1) * F, bias is not None)
    w_in.fill(WeightSource(src, ins).ggml_parts(), bias)
    if down.endswith("down_t.weight"):
        t = src.tensors[down]
        w = t.float().t().contiguous().numpy()  # [d_model, d_ff]
        t.release()
        # row ranges on as many threads as the kernels take (numpy's loops free the GIL)
        with ThreadPoolExecutor(kernel_threads()) as ex:
            raw = np.concatenate(list(ex.map(lambda part: quantize(part, GGMLQuantizationType.Q8_0),
                                             np.array_split(w, min(D, 8))))).reshape(-1)
        parts = [(PANEL_TYPES["Q8_0"], to_panels(raw, "Q8_0", D, F), D)]
    else:
        parts = WeightSource(src, (down,)).ggml_parts()
    down_m = GGMLLinear(F, D)
    down_m.fill(parts)
    return DenseCopy(w_in, down_m)


def fill(model: Transformer, src: ModelSource, plan: Plan) -> None:
    """Read every planned weight once from the mapped file into its module."""
    cfg = plan.config
    fdt = FLOAT[plan.float_dtype]

    def extra(name: str) -> torch.Tensor | None:
        a = src.extra_array(name)
        return None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float32).copy())

    def float_param(owner: nn.Module, attr: str, canon: str, n: int | None = None) -> None:
        if canon not in src.tensors:
            raise src.missing(canon)
        t = src.tensors[canon]
        w = t.float(0, n) if n is not None else t.float()
        t.release()
        setattr(owner, attr, nn.Parameter(w.to(fdt).contiguous(), requires_grad=False))

    modules = dict(model.named_modules())
    linears = []  # (module, its plan): filled below
    for wp in plan.weights:
        if wp.storage == "sparse":
            continue
        m = modules[wp.module]
        if wp.origin == "shared":  # a tied LM head held as the embedding's own float tensor
            m.weight = model.tok_emb.weight
            m.fill(m.weight)
        elif isinstance(m, FileEmbedding):
            m.fill(src.tensors[wp.sources[0]])
        elif isinstance(m, nn.Embedding):
            n = m.num_embeddings
            float_param(m, "weight", wp.sources[0], n if wp.module == "pos_emb" else None)
        else:
            linears.append((m, wp))

    def fill_linear(job) -> None:
        m, wp = job
        _fill_linear(m, WeightSource(src, wp.sources), wp.origin, wp.shape, plan.panels)

    if cpu_loads():  # the panel copies run on the C pool already (threads here: no gain)
        for job in linears:
            fill_linear(job)
    else:  # torch's int4 repacking frees the GIL: each module its own job (RESULTS.md)
        with ThreadPoolExecutor(kernel_threads()) as ex:
            list(ex.map(fill_linear, linears))
    for path, norm in modules.items():  # every norm, by its module path
        if isinstance(norm, Norm):
            float_param(norm, "weight", path + ".weight")
            if src.norm_shift:
                norm.weight.add_(src.norm_shift)
            if norm.bias is not None:
                float_param(norm, "bias", path + ".bias")
    bundle_layout = None  # a bundled file's layout, read once for every layer
    for i, blk in enumerate(model.layers):
        p = f"layers.{i}."
        if isinstance(blk.ffn, SparseFFN):
            from ..sparse.ffn import Predicted
            from ..sparse.runtime import predictor_of

            wp = plan.weight(p + "ffn")
            up_bias = (WeightSource(src, (p + "ffn.up.bias",)).float()
                       if cfg.ffn_bias and p + "ffn.up.bias" in src.tensors else None)
            down_b = _bias_name(src, p + "ffn.down.weight")
            down_bias = (WeightSource(src, (down_b,)).float()
                         if cfg.ffn_bias and down_b in src.tensors else None)
            pred = (predictor_of(plan.sparse, i, extra)
                    if isinstance(blk.ffn.selector, Predicted) else None)
            if plan.sparse.disk is not None:  # hot neurons read now, the rest stay in the file
                from ..disk.tier import fill_disk_ffn

                if pred is not None:
                    blk.ffn.selector.fill(pred)
                fill_disk_ffn(model, i, src, plan, up_bias, down_bias)
                continue
            if plan.sparse.bundled is not None:
                from ..disk.layout import layout_of, read_packed

                if bundle_layout is None:
                    bundle_layout = layout_of(src)
                packed = read_packed(src, i, 0, cfg.d_ff, up_bias, bundle_layout)
            else:
                packed = _packed_ffn(src, wp.sources, cfg.ffn_kind, plan.sparse.ffn_dtype,
                                     up_bias, plan.sparse.q4_gates, plan.sparse.q4_ups)
            if plan.sparse.gpu_index is not None:  # a mask placement: its neurons first
                order = torch.from_numpy(np.argsort(~plan.sparse.gpu_index[i], kind="stable"))
                packed = packed.select(order)
                if pred is not None:
                    pred.fc2 = pred.fc2[order].contiguous()
                    pred.bias = None if pred.bias is None else pred.bias[order].contiguous()
            if pred is not None:
                blk.ffn.selector.fill(pred)
            copy = (_dense_copy(src, wp.sources, up_bias, cfg.ffn.gated)
                    if plan.sparse.batch_dense else None)
            blk.ffn.fill(packed, down_bias, copy)
    if plan.sparse is not None and plan.sparse.disk is not None:
        from ..disk.tier import measure_read_gap, pin_mapped, read_by_rows

        if plan.sparse.disk.pinned:
            pin_mapped(src, plan.sparse.disk.pinned)
        read_by_rows(src, plan.sparse.disk.by_rows)
        measure_read_gap(model, plan)
    dev = torch.device(plan.device)
    if dev.type != "cpu":  # attention, norms, embeddings, LM head; cold FFN rows stay on the CPU
        model.to(dev)


@dataclass
class Loaded:
    """A built, filled model with its tokenizer, plan and source file."""

    model: Transformer
    tokenizer: Any
    source: ModelSource
    plan: Plan
    load_seconds: float = 0.0

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def format(self) -> str:
        return self.source.format

    @property
    def metadata(self) -> dict[str, Any]:
        return self.source.metadata

    @property
    def tensors(self):
        return self.source.infos

    @property
    def reader(self):
        return self.source.reader

    @property
    def file_bytes(self) -> int:
        return self.source.file_bytes

    @property
    def extras(self) -> dict[str, np.ndarray]:
        """The file's non-model tensors (predictors, statistics, placement) as numpy copies."""
        return {name: self.source.extra_array(name) for name in self.source.extras}


def build(src: ModelSource, plan: Plan) -> Transformer:
    """The model of ``plan`` on the meta device, then filled from ``src``."""
    with torch.device("meta"):
        model = Transformer(plan.config, PlannedModules(plan), FLOAT[plan.float_dtype],
                            kv_dtype=FLOAT[plan.kv_dtype])
    try:
        with torch.device("cpu"):
            fill(model, src, plan)
    except MemoryError as e:
        raise SparseInferError(f"{src.path}: out of memory while loading (the plan needs "
                               f"{plan.nbytes / 2**30:.2f} GiB of weights): {e}") from None
    except RuntimeError as e:
        if "alloc" in str(e).lower() or "memory" in str(e).lower():
            raise SparseInferError(f"{src.path}: out of memory while loading (the plan needs "
                                   f"{plan.nbytes / 2**30:.2f} GiB of weights): {e}") from None
        raise
    return model


def load(path, dtype: str = "fp32", *, max_seq_len: int | None = None,
         ffn_kind: str | None = None, n_ctx: int | None = None, check_memory: bool = True,
         **plan_options) -> Loaded:
    """Open, plan, check memory, build and fill. ``plan_options`` go to ``make_plan`` (device,
    dense, mode, ffn_dtype, threshold, vram_budget, fused, ...)."""
    t0 = time.perf_counter()
    src = open_source(path, max_seq_len=max_seq_len, ffn_kind=ffn_kind)
    if "fused" not in plan_options:
        plan_options["fused"] = False  # library callers get the plain torch path by default
    plan = make_plan(src, dtype, n_ctx=n_ctx, **plan_options)
    log.info("%s", plan.summary())
    if check_memory:
        plan.check_memory(min(n_ctx or 4096, src.config.max_seq_len), src.path)
    tokenizer = src.tokenizer()
    model = build(src, plan)
    release_heap()
    dt = time.perf_counter() - t0
    log.info("loaded %s in %.1f s: %s, %d layers, d_model %d, ffn %s", src.path, dt,
             src.config.arch, src.config.n_layers, src.config.d_model, src.config.ffn_kind)
    return Loaded(model, tokenizer, src, plan, dt)
