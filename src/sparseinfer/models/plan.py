"""Decide every weight's final form before any weight is read: the load plan.

``make_plan`` is one pure function of the opened file (types, shapes, sparse metadata), the
requested dtype, the sparse options and the device. For each module it names the storage (see
``STORAGES``), the file tensors it is made of and the bytes it will hold; ``Plan.check_memory``
compares the total with the memory this machine has before anything is allocated, and
``Plan.summary()`` prints it. ``models/build.py`` builds the model on the meta device from the plan
and fills each module once from the mapped file.

Storage, by ``--dtype``:
- ``auto`` (default): every tensor keeps its file's precision. Quantized projections and the
  LM head stay in the mapped file as they are (``ggml``: Q4_0 ... Q6_K blocks, computed by the
  C kernels of ``sparseinfer.cpu``: nothing copied or repacked except the Q/K rows llama.cpp
  permuted). Without that library: Q4_0 / Q4_1 / Q4_K become torch's int4 layout (``q4``, the
  same blocks), other types per-row ``int8``. 16-bit float projections (F16 / BF16, GGUF or
  safetensors) stay 16-bit on the C kernels (``ggml`` too: the rows where the file is mapped);
  other float tensors, and 16-bit ones without the C library, are ``fp32``.
  Nothing is requantized to fewer bits than the file has.
- ``q4``: every projection 4-bit (the file's blocks where it has them, else Q4_1's rule), the LM
  head int8.
- ``fp32`` / ``bf16``: every projection in that float type.
Token embeddings of quantized GGUFs and of 16-bit GGUFs and safetensors stay in the mapped file
(``file``: rows made float on lookup). A file with predictors gets sparse FFN layers (``sparse``) unless ``dense`` is asked.

Where the C library does not load (``cpu.loads()``: another CPU architecture, an x86 CPU without
AVX2, ``SPARSEINFER_C_KERNELS=0``) the plan keeps to torch's and numba's kernels: the weights as
above without ``ggml``, the fused decode only for plain llama blocks (numba's, float32 caches),
sparse rows in int8, bf16 or fp32 (q4 rows are refused with what to ask for instead).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, replace

import torch

from ..config import ModelConfig
from ..cpu import loads as cpu_loads
from ..errors import ModelFileError, SparseInferError
from ..fileio import available_memory
from ..sparse.packed import INT8_BLOCK
from .loading import ModelSource

log = logging.getLogger(__name__)

GIB = 1 << 30
DTYPE_CHOICES = ("auto", "fp32", "bf16", "q4")
FFN_DTYPES = ("auto", "fp32", "bf16", "int8", "q4")
# per weight of a sparse row, scales included (int8: a float32 per INT8_BLOCK weights)
ROW_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / INT8_BLOCK, "q4": 18 / 32}
SELECTORS = ("predictor", "oracle", "all")
KV_TYPES = ("auto", "fp32", "fp16")  # --cache-type
BATCH_FFN = ("auto", "sparse", "dense")  # --batch-ffn
# --batch-ffn auto: a dense copy for batches where the predictors select at least this share
# of a layer's neurons on average (two rows' union then covers at least 3/4 of them if the
# rows' sets were independent)
BATCH_DENSE_MIN_DENSITY = 0.5
FLOAT_KINDS = ("F32", "F16", "BF16", "float32", "float16", "bfloat16", "F64", "float64")

# storage name -> bytes per weight of a [rows, cols] matrix (rows, cols) -> bytes
STORAGES = {
    "fp32": lambda n, k: 4 * n * k,
    "bf16": lambda n, k: 2 * n * k,
    "q4": lambda n, k: n * k // 2 + 4 * n * (k // 32),  # int4 pack + bf16 scale/zero per 32
    "int8": lambda n, k: n * k + 6 * n,  # int8 + fp32 and bf16 row scales
}
GGML_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # sparseinfer.cpu
# 16-bit float weights the C kernels read as stored (GGUF's type names, safetensors' dtypes)
GGML_FLOATS = ("F16", "BF16")


@dataclass(frozen=True)
class WeightPlan:
    """One module's weight: where it comes from and how it is held."""

    module: str  # module path, e.g. "layers.3.attn.wqkv"
    storage: str  # key of STORAGES, "file" (rows read from the mapped file) or "sparse"
    sources: tuple[str, ...]  # canonical tensor names, fused in this order
    shape: tuple[int, int]  # (out, in) of the fused weight
    nbytes: int
    origin: str = ""  # "file blocks" | "requantized" | "dequantized" | "as stored"


@dataclass(frozen=True)
class SparsePlan:
    """How the sparse FFN layers are built (a file with predictors, not ``--dense``)."""

    selector: str  # "predictor" | "oracle" | "all": which neurons each token computes
    ffn_dtype: str  # storage of the bundled rows: fp32 | bf16 | int8
    thresholds: tuple[float, ...]  # predictor logit threshold per layer
    oracle_thresholds: tuple[float, ...]  # magnitude threshold per layer (oracle, non-ReLU)
    oracle_score: str  # "output" | "output_norm" | "gate"
    hot_counts: tuple[int, ...]  # neurons on the fast tier per layer (0 on a CPU-only run)
    device: str  # the fast tier
    split_tiers: bool | None = None  # tests: force the two-tier path with the CPU standing in
    # what the predictors read: the FFN's input, or the residual stream before its norm
    # (PowerInfer's files, as its runtime computes them)
    predictor_input: str = "ffn_input"
    gpu_index: tuple | None = None  # per layer: boolean mask of fast-tier neurons (PowerInfer)
    bundled: str | None = None  # row storage of a file with bundled neurons (disk/layout.py)
    disk: object | None = None  # disk.plan.DiskPlan: cold neurons read from the file
    # int8 rows of a ReLU gate: the file's Q4_0 gate rows held apart as q4 rows instead of int8
    # ones, the C kernels taking the gates from them (sparse/packed.py; ``q4_gates_apart``)
    q4_gates: bool = False
    # with q4_gates, the file's Q4_0 up rows as q4 rows too, each neuron's one bundle its up row
    # and its int8 down row (sparse/packed.py's dtype "q4i8"; ``q4_ups_apart``)
    q4_ups: bool = False
    # several rows at once (a batched step, a prompt) compute every neuron from a dense copy of
    # the FFN held beside the bundles (the file's gate/up blocks, the down projection's, or
    # down_t's as Q8_0): where the predictors select most neurons, a batch's union is nearly
    # every neuron and the dense product is the faster way to it (``batch_ffn``)
    batch_dense: bool = False

    def q4_rows_note(self, sep: str) -> str:
        """What of the rows stays 4-bit beside the int8 rows, for the plan's lines ("" if
        nothing), after ``sep``."""
        if not self.q4_gates:
            return ""
        return sep + ("q4 gates and ups" if self.q4_ups else "q4 gates")


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    dtype: str  # as asked: auto | fp32 | bf16 | q4
    float_dtype: str  # fp32 | bf16: activations, norms, float weights
    weights: tuple[WeightPlan, ...]
    sparse: SparsePlan | None
    fused_decode: bool  # single-token decode through fused/ kernels (CPU, fp32, RMSNorm + RoPE)
    device: str
    kv_bytes_per_token: int
    kv_dtype: str = "fp32"  # the KV cache's elements: fp32 | fp16 | bf16 (the activations')
    by_module: dict[str, WeightPlan] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.by_module.update({w.module: w for w in self.weights})

    def weight(self, module: str) -> WeightPlan:
        return self.by_module[module]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def panels(self) -> bool:
        """Whether the C library's Q4_0 / Q4_1 / Q8_0 matrices are copied into panels of 16 rows
        (``cpu/panels.py``, the same bytes): always, except under a disk tier, whose budget
        counts on the mapped weights it does not lock staying pageable."""
        return self.sparse is None or self.sparse.disk is None

    @property
    def label(self) -> str:
        """What the weights are, in one word (shown by the CLI as "weights: ...")."""
        kinds = {w.storage for w in self.weights if w.module.startswith("layers.")}
        if self.dtype != "auto":
            return self.dtype
        for k in ("ggml", "q4", "int8"):
            if k in kinds:
                return k
        return self.float_dtype

    def needed_bytes(self, n_ctx: int) -> int:
        # with a disk tier, mapped weights beyond the budget are paged by the kernel, not held
        paged = self.sparse.disk.paged_bytes if self.sparse and self.sparse.disk else 0
        return self.nbytes - paged + self.kv_bytes_per_token * n_ctx

    def check_memory(self, n_ctx: int, path) -> None:
        """Raise one clear error when the weights and KV cache will not fit the memory left."""
        need, have = self.needed_bytes(n_ctx), available_memory()
        if need > have:
            raise SparseInferError(
                f"{path}: needs {need / GIB:.2f} GiB (weights {self.nbytes / GIB:.2f} GiB as "
                f"planned, KV cache {self.kv_bytes_per_token * n_ctx / GIB:.2f} GiB for "
                f"{n_ctx} tokens) but {have / GIB:.2f} GiB is available; try a smaller -c, "
                f"--dtype q4, or a machine with more memory")

    def summary(self) -> str:
        """A short table: bytes per storage kind, where the weights come from."""
        rows: dict[tuple[str, str], list[int]] = {}
        for w in self.weights:
            r = rows.setdefault((w.storage, w.origin), [0, 0])
            r[0] += 1
            r[1] += w.nbytes
        lines = [f"plan: {self.config.name or self.config.arch}, --dtype {self.dtype}, device "
                 f"{self.device}, fused decode {'on' if self.fused_decode else 'off'}"
                 + (f", sparse FFN ({self.sparse.selector}, {self.sparse.ffn_dtype} rows"
                    f"{self.sparse.q4_rows_note(', ')}"
                    f"{', a dense copy for batches' if self.sparse.batch_dense else ''})"
                    if self.sparse else "")]
        for (storage, origin), (n, b) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {storage:6s} {origin:12s} {n:5d} weights {b / 2**20:10.1f} MiB")
        lines.append(f"  total  {self.nbytes / 2**20:10.1f} MiB + KV cache "
                     f"{self.kv_bytes_per_token / 1024:.1f} KiB per token ({self.kv_dtype})")
        if self.sparse is not None and self.sparse.disk is not None:
            lines.append(self.sparse.disk.summary())
        return "\n".join(lines)


def has_predictors(src: ModelSource) -> bool:
    return "blk.0.fc1.weight" in src.extras


def _int4_available(device: str) -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and torch.device(device).type == "cpu"


def make_plan(src: ModelSource, dtype: str = "auto", *, device: str = "cpu",
              dense: bool = False, mode: str = "predictor", ffn_dtype: str = "auto",
              threshold: float | None = None, vram_budget: float | None = None,
              split_tiers: bool | None = None, min_split: int = 256,
              fused: bool = True, gpu_index: str | None = None,
              ram_budget: float | None = None, disk_options=None,
              n_ctx: int | None = None, kv_type: str = "auto", q4_gates: bool = True,
              q4_ups: bool = True, batch_ffn: str = "auto") -> Plan:
    """The plan for ``src`` (see the module docstring). ``dense`` ignores predictors; ``mode``
    picks the sparse selector; ``fused`` allows the fused single-token decode kernels;
    ``gpu_index``: a PowerInfer GPU index file (``blk.N.gpu_idx`` masks) used as the placement;
    ``ram_budget`` (GiB, or ``disk_options`` with explicit counts): cold FFN neurons stay in the
    file and are read per token (``sparseinfer.disk``; ``n_ctx`` sizes the KV cache it counts);
    ``kv_type``: the KV cache's elements (``KV_TYPES``). "auto": float16 keys and values (as
    llama.cpp holds them) where the default weights (``--dtype auto``) can decode through the
    fused kernels, whose attention reads them in C (``cpu.DecodeBlock``, ``cpu.attend_token``),
    else the activations' type; an asked-for fp16 cache works everywhere (the torch paths cast
    it). ``q4_gates``: hold a ReLU gate's rows apart as the file's 4-bit rows beside int8
    bundles of up and down rows where the file allows (``q4_gates_apart``; False: int8 gate
    rows in the bundles); ``q4_ups``, with them, the file's 4-bit up rows too, beside int8 down
    rows (``q4_ups_apart``). ``batch_ffn``: how several rows at once compute a sparse FFN
    ("sparse": over the bundles, each row its own set; "dense": every neuron from a dense copy
    of the FFN, held beside the bundles; "auto": dense where the file's predictors select at
    least ``BATCH_DENSE_MIN_DENSITY`` of the neurons and the C kernels take the copy)."""
    if dtype not in DTYPE_CHOICES:
        raise SparseInferError(f"dtype: expected one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if ffn_dtype not in FFN_DTYPES:
        raise SparseInferError(f"--ffn-dtype: expected one of {list(FFN_DTYPES)}, got "
                               f"{ffn_dtype!r}")
    if mode not in SELECTORS:
        raise SparseInferError(f"--sparse-mode: expected one of {list(SELECTORS)}, got {mode!r}")
    if batch_ffn not in BATCH_FFN:
        raise SparseInferError(f"--batch-ffn: expected one of {list(BATCH_FFN)}, got "
                               f"{batch_ffn!r}")
    if kv_type not in KV_TYPES:
        raise SparseInferError(f"--cache-type: expected one of {list(KV_TYPES)}, got {kv_type!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparseInferError("--device cuda: no CUDA device is available on this machine")
    cfg = src.config
    sparse = None
    from ..disk.layout import is_bundled, layout_of

    bundled = layout_of(src).dtype if is_bundled(src) else None
    if bundled is not None and ffn_dtype != bundled:
        log.info("%s: neuron bundles are stored as %s rows: --ffn-dtype %s not used", src.path,
                 bundled, ffn_dtype)
        ffn_dtype = bundled
    if bundled is not None and (dense or not has_predictors(src)):
        raise SparseInferError(f"{src.path}: a file with bundled neurons runs sparse only; "
                               f"expected no --dense")
    disk_tier = ram_budget is not None or disk_options is not None  # cold neurons in the file
    if disk_tier and bundled is None:
        raise SparseInferError(f"{src.path}: --ram-budget needs a sparse file with bundled "
                               f"neurons; write one with `python -m sparseinfer.disk bundle "
                               f"{src.path} OUT.gguf`")
    if has_predictors(src) and not dense:
        ffn_dtype = _auto_ffn_dtype(src, dtype) if ffn_dtype == "auto" else ffn_dtype
        if ffn_dtype == "q4" and not cpu_loads():
            what = "the file's bundles" if bundled else "--ffn-dtype q4"
            raise SparseInferError(f"{src.path}: q4 neuron rows ({what}) run on the C kernels, "
                                   f"which do not load here (the warning above says why); "
                                   f"expected --ffn-dtype int8, bf16 or fp32")
        sparse = _sparse_plan(src, mode, ffn_dtype, threshold, device, vram_budget, split_tiers,
                              min_split, gpu_index)
        gates_apart = q4_gates and q4_gates_apart(src, ffn_dtype, bundled)
        sparse = replace(sparse, bundled=bundled, q4_gates=gates_apart,
                         q4_ups=gates_apart and q4_ups and q4_ups_apart(src))
        sparse = replace(sparse, batch_dense=_batch_dense(src, sparse, batch_ffn, dtype,
                                                          disk_tier))
    elif threshold is not None or vram_budget is not None:
        log.warning("%s has no predictors (or --dense): sparse options ignored, running dense",
                    src.path)
    float_dtype = "bf16" if dtype == "bf16" else "fp32"
    cpu = dev.type == "cpu"
    int4 = _int4_available(device) and (cfg.d_model % 32 == 0)
    if dtype == "q4" and not int4:
        raise SparseInferError(f"--dtype q4: 4-bit weights need torch's int4 CPU kernel "
                               f"(torch >= 2.5) on a CPU device and d_model a multiple of 32; "
                               f"found torch {torch.__version__}, device {device}, d_model "
                               f"{cfg.d_model}")

    def kinds(sources):
        return [src.tensors[s].kind for s in sources if s in src.tensors]

    def storage_for(sources, shape, head=False) -> tuple[str, str]:
        ks = kinds(sources)
        # a transposed source (down_t) cannot keep its blocks: its rows become columns
        file4 = (ks and all(k in ("Q4_0", "Q4_1", "Q4_K") for k in ks)
                 and not any(s.endswith("down_t.weight") for s in sources))
        if dtype in ("fp32", "bf16"):
            return dtype, "dequantized" if any(k not in FLOAT_KINDS for k in ks) else "as stored"
        if dtype == "q4":
            if head:
                return "int8", "requantized"
            if shape[1] % 32:
                return "fp32", "dequantized"
            return "q4", "file blocks" if file4 else "requantized"
        # auto: keep the file's precision; quantized blocks run in place where the C kernels
        # take them (rows of whole blocks: 256 weights for K-quants, 32 for the others)
        transposed = any(s.endswith("down_t.weight") for s in sources)
        block = 256 if any(k.endswith("_K") for k in ks) else 32
        if ks and cpu and not transposed and shape[1] % block == 0 and cpu_loads():
            if all(k in GGML_TYPES for k in ks):
                return "ggml", "file blocks"
            # 16-bit floats stay 16-bit (half fp32's memory and bytes a token): the C kernels'
            # F16 / BF16 rows, except rows the loader regroups (HF Falcon's fused q/k/v)
            regrouped = src.qkv_grouped and any(".attn.wqkv." in s for s in sources)
            if all(k in GGML_FLOATS for k in ks) and not regrouped:
                return "ggml", "as stored"
        if not ks or all(k in FLOAT_KINDS for k in ks) or not cpu:
            return float_dtype, "as stored" if not ks or all(k in FLOAT_KINDS for k in ks) \
                else "dequantized"
        if file4 and int4 and shape[1] % 32 == 0 and not head:
            return "q4", "file blocks"
        return "int8", "requantized"

    weights: list[WeightPlan] = []
    D, F, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    E = cfg.emb_dim or D  # embedding and LM-head width
    q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd

    def expected(canon: str) -> tuple[int, ...] | None:
        """The shape a canonical tensor must have (None: not checked here)."""
        leaf = canon.split(".", 2)[-1] if canon.startswith("layers.") else canon
        leaf = re.sub(r"^ffn\.experts\.\d+\.", "ffn.", leaf)  # each expert: a dense FFN's
        return {"attn.wqkv.weight": (q_out + 2 * kv_out, D), "ffn.w_in.weight": (2 * F, D),
                "ffn.router.weight": (cfg.n_experts, D),
                "attn.wq.weight": (q_out, D), "attn.wk.weight": (kv_out, D),
                "attn.wv.weight": (kv_out, D), "attn.wo.weight": (D, q_out),
                "ffn.gate.weight": (F, D), "ffn.up.weight": (F, D), "ffn.down.weight": (D, F),
                "ffn.down_t.weight": (F, D), "tok_emb.weight": (cfg.vocab_size, E),
                "lm_head.weight": (cfg.vocab_size, E), "project_in.weight": (D, E),
                "project_out.weight": (E, D)}.get(leaf)

    def check(canon: str) -> None:
        if canon not in src.tensors:
            raise src.missing(canon)
        t, want = src.tensors[canon], expected(canon)
        if want is not None and tuple(t.shape) != want:
            raise ModelFileError(f"{src.path}: tensor {t.name!r}: expected shape {want}, found "
                                 f"{tuple(t.shape)}")

    def add(module, sources, shape, head=False):
        for s in sources:
            check(s)
        storage, origin = storage_for(sources, shape, head)
        nbytes = (sum(src.tensors[s].nbytes for s in sources) if storage == "ggml"
                  else STORAGES[storage](*shape))
        if storage == "ggml" and sources == ["tok_emb.weight"] and weights[0].storage == "file":
            nbytes = 0  # a tied head reads the embedding's own mapped blocks
        weights.append(WeightPlan(module, storage, tuple(sources), shape, nbytes, origin))

    check("tok_emb.weight")
    emb = src.tensors["tok_emb.weight"]
    # a quantized or 16-bit embedding stays in the map (rows made float on lookup)
    mapped = emb.gguf is not None or emb.span is not None
    if dtype == "auto" and (emb.quantized or (mapped and emb.kind in GGML_FLOATS)):
        weights.append(WeightPlan("tok_emb", "file", ("tok_emb.weight",), (cfg.vocab_size, E),
                                  emb.nbytes, "mapped"))
    else:
        weights.append(WeightPlan("tok_emb", float_dtype, ("tok_emb.weight",),
                                  (cfg.vocab_size, E), STORAGES[float_dtype](cfg.vocab_size, E),
                                  "dequantized" if emb.quantized else "as stored"))
    if cfg.pos == "learned":
        n_pos = cfg.max_seq_len + cfg.pos_offset
        weights.append(WeightPlan("pos_emb", "fp32", ("pos_emb.weight",), (n_pos, D),
                                  4 * n_pos * D, "as stored"))
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        fused_qkv = p + "attn.wqkv.weight" in src.tensors  # Phi-3 stores q/k/v as one tensor
        add(p + "attn.wqkv", [p + "attn.wqkv.weight"] if fused_qkv
            else [p + f"attn.{n}.weight" for n in ("wq", "wk", "wv")], (q_out + 2 * kv_out, D))
        add(p + "attn.wo", [p + "attn.wo.weight"], (D, q_out))
        if sparse is not None:
            down = p + "ffn.down_t.weight" if p + "ffn.down_t.weight" in src.tensors \
                else p + "ffn.down.weight"
            ins = ([p + "ffn.gate.weight"] if cfg.ffn.gated else []) + [p + "ffn.up.weight"]
            if p + "ffn.w_in.weight" in src.tensors:  # Phi-3: gate rows then up rows, one tensor
                ins = [p + "ffn.w_in.weight"]
            if bundled is not None:  # one tensor of bundles: blk.N.ffn_bundle
                ins, down = [], f"blk.{i}.ffn_bundle"
            for s in [*ins, down] if bundled is None else []:
                check(s)
            n_mats = 3 if cfg.ffn.gated else 2
            elt = ROW_BYTES[sparse.ffn_dtype]
            if sparse.q4_gates:  # the gate (and up) rows apart: the file's 4-bit rows, not int8
                n_q4 = 2 if sparse.q4_ups else 1
                nbytes = int(((n_mats - n_q4) * elt + n_q4 * ROW_BYTES["q4"]) * F * D)
            else:
                nbytes = int(n_mats * F * D * elt)
            fc1 = src.extras.get(f"blk.{i}.fc1.weight")
            fc2 = src.extras.get(f"blk.{i}.fc2.weight")
            if sparse.selector == "predictor" and (fc1 is None or fc2 is None):
                raise SparseInferError(f"{src.path}: sparse model is missing tensor "
                                       f"'blk.{i}.fc1.weight' or 'blk.{i}.fc2.weight'")
            if sparse.selector == "predictor":
                n = math.prod(fc1.shape) + math.prod(fc2.shape)  # fp32, else 16-bit in memory
                nbytes += n * (4 if sparse.ffn_dtype == "fp32" else 2)
            if sparse.batch_dense:
                nbytes += sum(src.tensors[s].nbytes for s in ins) + dense_down_bytes(src, down)
            weights.append(WeightPlan(p + "ffn", "sparse", (*ins, down), (F, D), nbytes,
                                      f"{sparse.ffn_dtype} rows"
                                      + sparse.q4_rows_note(" + ")
                                      + (" + a dense copy" if sparse.batch_dense else "")))
        elif cfg.n_experts:  # the router, then each expert as a dense FFN
            add(p + "ffn.router", [p + "ffn.router.weight"], (cfg.n_experts, D))
            for e in range(cfg.n_experts):
                q = f"{p}ffn.experts.{e}."
                add(q + "w_in", [q + "gate.weight", q + "up.weight"], (2 * F, D))
                add(q + "down", [q + "down.weight"], (D, F))
        else:
            ins = [p + f"ffn.{n}.weight" for n in (("gate", "up") if cfg.ffn.gated else ("up",))]
            if p + "ffn.w_in.weight" in src.tensors:  # Phi-3: gate and up as one tensor
                ins = [p + "ffn.w_in.weight"]
            add(p + "ffn.w_in", ins, ((2 if cfg.ffn.gated else 1) * F, D))
            down = p + "ffn.down.weight"
            if down not in src.tensors and p + "ffn.down_t.weight" in src.tensors:
                down = p + "ffn.down_t.weight"
            add(p + "ffn.down", [down], (D, F))
    if cfg.emb_dim:  # OPT-350m: embeddings projected in and out of d_model
        add("project_in", ["project_in.weight"], (D, E))
        add("project_out", ["project_out.weight"], (E, D))
    if cfg.tie_embeddings or "lm_head.weight" not in src.tensors:
        add("lm_head", ["tok_emb.weight"], (cfg.vocab_size, E), head=True)
        if weights[-1].storage == weights[0].storage:  # float: one tensor serves both
            weights[-1] = WeightPlan("lm_head", weights[0].storage, ("tok_emb.weight",),
                                     (cfg.vocab_size, E), 0, "shared")
    else:
        add("lm_head", ["lm_head.weight"], (cfg.vocab_size, E), head=True)
    c_lib = cpu and cpu_loads()  # else numba's decode, float32 caches only
    fusable = (cpu and float_dtype == "fp32" and cfg.norm == "rms" and cfg.pos == "rope"
               and (cfg.plain_block or (c_lib and _c_blocks(
                   cfg, weights, None if sparse is None else (sparse, disk_tier)))))
    kv_dtype = kv_type if kv_type != "auto" else (
        "fp16" if dtype == "auto" and fusable and c_lib else float_dtype)
    fused_ok = fused and fusable and (c_lib or kv_dtype == "fp32")  # numba reads float32 caches
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * hd * (4 if kv_dtype == "fp32" else 2)
    if sparse is not None and disk_tier:
        from ..disk.plan import DiskOptions, plan_disk

        if sparse.gpu_index is not None:
            raise SparseInferError("--gpu-index with --ram-budget: a file with bundled neurons "
                                   "keeps its own neuron order (hottest first), which places "
                                   "the fast tier; expected --vram-budget instead")
        # three tiers: the fast device's hot prefix (--vram-budget's placement), then RAM, then
        # the file; on a CPU-only run (no split) RAM is the fast tier. The rule SparseFFN splits by
        fast = (dev.type != "cpu") if sparse.split_tiers is None else sparse.split_tiers
        ctx = min(n_ctx or 4096, cfg.max_seq_len)
        disk, weights = plan_disk(src, sparse, weights, kv * ctx if cpu else 0, ram_budget,
                                  disk_options or DiskOptions(), n_ctx=ctx,
                                  fast_counts=sparse.hot_counts if fast else None,
                                  dense_in_ram=cpu)
        sparse = replace(sparse, disk=disk)
    return Plan(cfg, dtype, float_dtype, tuple(weights), sparse, fused_ok, str(dev), kv, kv_dtype)


# the four products of a block, by module path suffix; the C decode block runs them when each
# is on the C kernels (the file's blocks, or float32)
_BLOCK_LINEARS = ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.down")


def _c_blocks(cfg: ModelConfig, weights: list[WeightPlan], sparse) -> bool:
    """Whether every block of a model that is not a plain llama block (q/k norms, post-norms,
    windows, a custom scale, soft-capped scores: Gemma 2/3, Qwen3) can decode on
    ``cpu.DecodeBlock``: the numba path around the block's modules implements only the plain
    block, so such models are fused only when the C block takes every layer. ``sparse``:
    (SparsePlan, whether a disk tier holds the cold neurons) of a sparse model, whose FFNs the
    C block takes as ``SparseFFN.c_block_ffn`` does — one tier on the CPU, float16 predictors
    (or every neuron) over the C kernels' rows (q4, or int8 with d_model a multiple of 32)."""
    if cfg.parallel or cfg.post_norm:
        return False
    if sparse is not None and _not_in_c_block(cfg, *sparse) is not None:
        return False
    if cfg.n_experts and cfg.post_norms:  # (the C block's attention-only mode has no FFN post-norm)
        return False
    # a sparse FFN inside the C block, or experts after its attention (fused/experts.py): the C
    # block's products are the attention's two
    linears = _BLOCK_LINEARS[:2] if sparse is not None or cfg.n_experts else _BLOCK_LINEARS
    storage = {w.module: w.storage for w in weights}
    return all(storage.get(f"layers.{i}.{name}") in ("ggml", "fp32")
               for i in range(cfg.n_layers) for name in linears)


def _not_in_c_block(cfg: ModelConfig, sp: SparsePlan, disk_tier: bool) -> str | None:
    """Why the C block cannot take the sparse FFNs of ``sp`` (None: it can, as
    ``SparseFFN.c_block_ffn`` does): a disk tier, a fast tier, a selector other than the
    predictor or every neuron, rows other than the C kernels' (q4, int8 with d_model a multiple
    of 32)."""
    if disk_tier:
        return "the cold neurons stay in the file (disk tier)"
    if torch.device(sp.device).type != "cpu" or (sp.split_tiers and any(sp.hot_counts)):
        return "the FFN has a fast tier (--device)"
    if sp.selector not in ("predictor", "all"):
        return (f"the C block takes the predictor's sets or every neuron (here --sparse-mode "
                f"{sp.selector})")
    if not (sp.ffn_dtype == "q4" or (sp.ffn_dtype == "int8" and cfg.d_model % INT8_BLOCK == 0)):
        return (f"the C block takes q4 rows or int8 rows of a d_model multiple of {INT8_BLOCK} "
                f"(here {sp.ffn_dtype} rows, d_model {cfg.d_model})")
    return None


def q4_gates_apart(src: ModelSource, ffn_dtype: str, bundled: str | None) -> bool:
    """Whether int8 sparse rows can take their gates from the file's own 4-bit gate rows: a
    ReLU gate (ReGLU, dReLU) stored as Q4_0 in every layer (its numbers kept exactly, as q4
    rows), rows of whole blocks of 32, bundles made at load (not a file's bundles), the C
    library loaded. Then a token reads half the bytes for each selected neuron's gate, and the
    int8 rows of the neurons whose gate fired only, and the layer holds 18 bytes per 32 gate
    weights instead of 36 (benchmarks/gates_apart_int8.py, relu_7b.py; RESULTS.md)."""
    cfg = src.config
    kind = cfg.ffn
    if (bundled is not None or ffn_dtype != "int8" or not kind.gated or kind.gate_act != "relu"
            or cfg.d_model % INT8_BLOCK or not cpu_loads()):
        return False
    for i in range(cfg.n_layers):
        t = src.tensors.get(f"layers.{i}.ffn.gate.weight")
        if t is None or t.kind != "Q4_0" or tuple(t.shape) != (cfg.d_ff, cfg.d_model):
            return False
    return True


def q4_ups_apart(src: ModelSource) -> bool:
    """Whether the file's up rows can stay 4-bit too where ``q4_gates_apart`` holds: an up
    tensor of its own stored as Q4_0 in every layer (the bundles then hold each neuron's q4 up
    row and int8 down row: 3/4 of the bytes of int8 up and down rows and their scales, one
    read a fired neuron; benchmarks/RESULTS.md)."""
    cfg = src.config
    for i in range(cfg.n_layers):
        t = src.tensors.get(f"layers.{i}.ffn.up.weight")
        if t is None or t.kind != "Q4_0" or tuple(t.shape) != (cfg.d_ff, cfg.d_model):
            return False
    return True


def dense_down_bytes(src: ModelSource, down: str) -> int:
    """Bytes of a sparse FFN's dense copy of its down projection: the file's blocks of a
    ``down`` tensor, or Q8_0 blocks made from a ``down_t`` one (``SparsePlan.batch_dense``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = src.tensors[down]
    if not down.endswith("down_t.weight"):
        return t.nbytes
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    return t.shape[0] * t.shape[1] // elems * size


def _batch_dense(src: ModelSource, sparse: SparsePlan, batch_ffn: str, dtype: str,
                 disk_tier: bool) -> bool:
    """``SparsePlan.batch_dense`` for ``--batch-ffn``: "dense" where a dense copy can be made
    (else an error saying why not), "auto" there too if the file's predictors select at least
    ``BATCH_DENSE_MIN_DENSITY`` of the neurons on average, "sparse" never."""
    if batch_ffn == "sparse":
        return False
    why = _no_dense_copy(src, sparse, dtype, disk_tier)
    if why is not None:
        if batch_ffn == "dense":
            raise SparseInferError(f"--batch-ffn dense: no dense copy of the FFN can be used "
                                   f"here: {why}")
        return False
    if batch_ffn == "dense":
        return True
    n = src.config.n_layers
    density = src.metadata.get("sparseinfer.predictor.density")
    if not isinstance(density, list) or len(density) != n:
        return False  # (a file without the statistic: PowerInfer's; its ReLU sets are sparse)
    return sum(float(d) for d in density) / n >= BATCH_DENSE_MIN_DENSITY


def _no_dense_copy(src: ModelSource, sparse: SparsePlan, dtype: str, disk_tier: bool) -> str | None:
    """Why the C block cannot take a dense copy of the sparse FFNs (None: it can): where it
    takes the sparse FFNs (``_not_in_c_block``) with predicted sets, the neurons not bundled in
    the file, and every layer's gate/up/down tensors blocks of the C kernels."""
    why = _not_in_c_block(src.config, sparse, disk_tier)
    if why is not None:
        return why
    if sparse.bundled is not None:
        return "the neurons are bundled in the file"
    if sparse.selector != "predictor":
        return f"the copy is for the predictor's sets (here --sparse-mode {sparse.selector})"
    if dtype != "auto" or not cpu_loads():
        return "the C kernels are not in use (--dtype auto, the C library)"
    cfg = src.config
    for i in range(cfg.n_layers):
        p = f"layers.{i}.ffn."
        ins = ([p + "w_in.weight"] if p + "w_in.weight" in src.tensors else
               [p + "gate.weight", p + "up.weight"] if cfg.ffn.gated else [p + "up.weight"])
        down = p + ("down.weight" if p + "down.weight" in src.tensors else "down_t.weight")
        kinds = [src.tensors[s].kind for s in ins if s in src.tensors]
        block = 256 if any(k.endswith("_K") for k in kinds) else 32
        down_ok = (down in src.tensors and (src.tensors[down].kind in GGML_TYPES
                   or down.endswith("down_t.weight")) and cfg.d_ff % 32 == 0)
        if (len(kinds) != len(ins) or any(k not in GGML_TYPES for k in kinds)
                or cfg.d_model % block or not down_ok):
            return (f"layer {i}'s gate/up/down tensors are not blocks the C kernels take "
                    f"({kinds}, d_model {cfg.d_model}, d_ff {cfg.d_ff})")
    return None


def _auto_ffn_dtype(src: ModelSource, dtype: str) -> str:
    """``--ffn-dtype auto``: with ``--dtype fp32``/``bf16`` the rows are in that float type;
    otherwise a quantized file's FFN rows become int8 with a scale per 32 weights (the transposed
    down projection cannot keep the file's blocks; rows and float16 predictors on the C
    kernels), or bf16 where d_model is not a multiple of 32, and a float file's stay fp32. On
    SmolLM2 and Gemma-3-270M int8 rows so gave bf16 rows' perplexity and decoded faster; one
    scale per row, the default once, cost perplexity (benchmarks/RESULTS.md). ``q4`` (4-bit
    bundles, the fastest, the down projection rounded to 4 bits again) is asked for."""
    if dtype in ("fp32", "bf16"):
        return dtype
    gate = src.tensors.get("layers.0.ffn.gate.weight") or src.tensors.get("layers.0.ffn.up.weight")
    if gate is None or not gate.quantized:
        return "fp32"
    return "int8" if src.config.d_model % INT8_BLOCK == 0 else "bf16"


def _sparse_plan(src: ModelSource, mode, ffn_dtype, threshold, device, vram_budget,
                 split_tiers, min_split, gpu_index=None) -> SparsePlan:
    cfg, meta = src.config, src.metadata
    n = cfg.n_layers
    if threshold is not None:
        thresholds = [float(threshold)] * n
    else:
        per_layer = meta.get("sparseinfer.predictor.thresholds")
        if isinstance(per_layer, list) and len(per_layer) == n:
            thresholds = [float(t) for t in per_layer]
        else:
            thresholds = [float(meta.get("powerinfer.sparse_threshold", 0.0))] * n
    oracle = meta.get("sparseinfer.sparsity.layer_thresholds")
    oracle_t = ([float(t) for t in oracle] if isinstance(oracle, list) and len(oracle) == n
                else [0.0] * n)
    score = str(meta.get("sparseinfer.sparsity.score", "output"))
    from ..offline.calibrate import SCORES

    if score not in SCORES:
        raise SparseInferError(f"{src.path}: sparseinfer.sparsity.score: expected one of "
                               f"{list(SCORES)}, found {score!r}")
    hot = _hot_counts(src, device, vram_budget, ffn_dtype, min_split)
    if vram_budget is not None and torch.device(device).type == "cpu" and not split_tiers:
        log.warning("--vram-budget %g GiB: no fast device on this run (--device cpu), so every "
                    "FFN neuron stays in RAM; expected --device cuda for a GPU tier",
                    vram_budget)
    masks = None
    if gpu_index is not None:
        masks = read_gpu_index(gpu_index, cfg.n_layers, cfg.d_ff)
        if torch.device(device).type == "cpu" and not split_tiers:
            log.warning("%s: a GPU index is a placement for a fast device; this run is CPU-only, "
                        "so it is ignored", gpu_index)
            masks = None
        else:
            hot = [int(m.sum()) for m in masks]
    return SparsePlan(mode, ffn_dtype, tuple(thresholds), tuple(oracle_t), score, tuple(hot),
                      str(torch.device(device)), split_tiers,
                      "residual" if src.powerinfer else "ffn_input",
                      None if masks is None else tuple(masks))


def read_gpu_index(path, n_layers: int, d_ff: int) -> list:
    """PowerInfer's GPU index file (``--reset-gpu-index`` / powerinfer-py's solver output: a
    GGUF, magic GGUF or PWRI, with ``blk.N.gpu_idx`` 0/1 masks and ``blk.N.gpu_bucket`` hot
    indices): the per-layer boolean masks of neurons placed on the fast device."""
    import numpy as np

    from pathlib import Path

    from .loading import open_gguf

    path = Path(path)
    if not path.is_file():
        raise SparseInferError(f"--gpu-index: file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (b"GGUF", b"PWRI"):
        raise SparseInferError(f"{path}: expected a PowerInfer GPU index (a GGUF file), found "
                               f"magic {magic!r}")
    reader = open_gguf(path, powerinfer=magic == b"PWRI")
    found = {t.name: np.asarray(t.data) for t in reader.tensors}
    masks = []
    for i in range(n_layers):
        m = found.get(f"blk.{i}.gpu_idx")
        if m is None:
            raise SparseInferError(f"{path}: expected tensor 'blk.{i}.gpu_idx' for layer {i} of "
                                   f"{n_layers}, found none")
        m = m.reshape(-1)
        if m.shape[0] != d_ff:
            raise SparseInferError(f"{path}: blk.{i}.gpu_idx: expected {d_ff} neurons, found "
                                   f"{m.shape[0]}")
        masks.append(m != 0)
    return masks


def _hot_counts(src: ModelSource, device: str, vram_budget: float | None, ffn_dtype: str,
                min_split: int) -> list[int]:
    """Fast-tier neurons per layer: none on a CPU-only run, else the stored placement, or a fresh
    ILP solve when ``vram_budget`` (GiB) is given."""
    import numpy as np

    cfg = src.config
    if vram_budget is None:
        if torch.device(device).type == "cpu":
            return [0] * cfg.n_layers
        out = []
        for i in range(cfg.n_layers):
            mask = src.extra_array(f"blk.{i}.gpu_idx")
            out.append(int(np.asarray(mask).sum()) if mask is not None else 0)
        return out
    from ..offline.solve import PlacementProblem, solve_placement

    if vram_budget < 0:
        raise SparseInferError(f"--vram-budget: expected GiB >= 0, got {vram_budget}")
    freqs = []
    for i in range(cfg.n_layers):
        f = src.extra_array(f"blk.{i}.act_freq")
        if f is None:
            raise SparseInferError(f"{src.path}: sparse model is missing tensor "
                                   f"'blk.{i}.act_freq'")
        freqs.append(np.asarray(f, dtype=np.float32))
    per_neuron = int((3 if cfg.ffn.gated else 2) * cfg.d_model * ROW_BYTES[ffn_dtype])
    attn = sum(src.tensors[f"layers.{i}.attn.{n}.weight"].nbytes
               for i in range(cfg.n_layers) for n in ("wq", "wk", "wv", "wo"))
    dense = [("embeddings", src.tensors["tok_emb.weight"].nbytes), ("attention", attn)]
    problem = PlacementProblem(tuple(freqs), tuple([per_neuron] * cfg.n_layers),
                               int(vram_budget * GIB), tuple(dense), min_split_neurons=min_split)
    sol = solve_placement(problem)
    log.info("placement for %.2f GiB: %s hot neurons", vram_budget, sum(sol.hot_counts))
    return list(sol.hot_counts)
