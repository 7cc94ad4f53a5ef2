"""Turn a loaded sparse GGUF (predictors, statistics, placement) into a sparse model in place.

Tensors and keys read (written by ``offline/export.py``, documented in docs/sparse-gguf.md):
``blk.N.fc1.weight``, ``blk.N.fc2.weight`` (+ ``blk.N.fc2.bias``), ``blk.N.act_freq``,
``blk.N.gpu_idx``; ``powerinfer.sparse_threshold``, ``sparseinfer.predictor.thresholds``,
``sparseinfer.sparsity.layer_thresholds``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import SparseInferError
from .ffn import BATCH_MODES, Predictor, SparseFFN
from .packed import PackedFFN

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class SparseInfo:
    """What the sparse runtime did to a model (shown by the CLI, used by benchmarks)."""

    mode: str
    ffn_dtype: str
    device: str
    thresholds: list[float]
    hot_counts: list[int]
    modules: list[SparseFFN] = field(default_factory=list, repr=False)

    def density(self) -> float:
        """Mean share of FFN neurons computed per token so far: decoded tokens, and prompt
        tokens of "union" / "masked" batches ("dense" batches are not counted)."""
        tok = sum(m.stats.tokens * m.d_ff for m in self.modules)
        return sum(m.stats.active for m in self.modules) / tok if tok else float("nan")

    def set_batch_mode(self, mode: str) -> None:
        """"auto" (the default, as measured by benchmarks/prefill.py: "union" up to
        ``ffn.UNION_MAX_TOKENS`` tokens and at any length for bf16/int8 rows, else "dense"),
        "dense" (every neuron), "union" (the union of the tokens' predicted sets, batched-sparse
        kernel) or "masked" (each token its own active set: perplexity of the sparse model)."""
        if mode not in BATCH_MODES:
            raise ValueError(f"batch mode: expected one of {list(BATCH_MODES)}, got {mode!r}")
        for m in self.modules:
            m.batch_mode = mode

    def reset_stats(self) -> None:
        for m in self.modules:
            m.stats.tokens = m.stats.active = 0


def _extra(loaded, name: str, layer: int, required: bool = True):
    key = f"blk.{layer}.{name}"
    if key not in loaded.extras:
        if required:
            raise SparseInferError(f"{loaded.path}: sparse model is missing tensor {key!r}")
        return None
    return torch.from_numpy(np.asarray(loaded.extras[key], dtype=np.float32).copy())


def layer_thresholds(loaded, override: float | None) -> list[float]:
    n = loaded.config.n_layers
    if override is not None:
        return [float(override)] * n
    per_layer = loaded.metadata.get("sparseinfer.predictor.thresholds")
    if isinstance(per_layer, list) and len(per_layer) == n:
        return [float(t) for t in per_layer]
    return [float(loaded.metadata.get("powerinfer.sparse_threshold", 0.0))] * n


def hot_counts(loaded, device: str, vram_budget: float | None,
               min_split: int = 256) -> list[int]:
    """Fast-tier neurons per layer: none on a CPU-only run, else the stored placement, or a fresh
    ILP solve when ``vram_budget`` (GiB) is given."""
    cfg = loaded.config
    if vram_budget is None:
        if torch.device(device).type == "cpu":
            return [0] * cfg.n_layers
        out = []
        for i in range(cfg.n_layers):
            mask = loaded.extras.get(f"blk.{i}.gpu_idx")
            out.append(int(np.asarray(mask).sum()) if mask is not None else 0)
        return out
    from ..offline.solve import PlacementProblem, solve_placement

    if vram_budget < 0:
        raise SparseInferError(f"--vram-budget: expected GiB >= 0, got {vram_budget}")
    freqs = []
    for i in range(cfg.n_layers):
        f = _extra(loaded, "act_freq", i)
        freqs.append(f.numpy())
    model = loaded.model
    elt = model.dtype.itemsize
    per_neuron = (3 if cfg.ffn.gated else 2) * cfg.d_model * elt
    dense = [
        ("embeddings", model.tok_emb.weight.numel() * elt),
        ("attention", sum(sum(p.numel() for p in b.attn.parameters()) for b in model.layers) * elt),
    ]
    problem = PlacementProblem(tuple(freqs), tuple([per_neuron] * cfg.n_layers),
                               int(vram_budget * GIB), tuple(dense),
                               min_split_neurons=min_split)
    sol = solve_placement(problem)
    log.info("placement for %.2f GiB: %s hot neurons", vram_budget, sum(sol.hot_counts))
    return list(sol.hot_counts)


def sparsify(loaded, *, dense: bool = False, threshold: float | None = None, device: str = "cpu",
             vram_budget: float | None = None, mode: str = "predictor", ffn_dtype: str = "fp32",
             split_tiers: bool | None = None, min_split: int = 256) -> SparseInfo | None:
    """Replace every dense FFN of ``loaded.model`` by a ``SparseFFN`` (in place).

    ``device`` is the fast tier (cpu or cuda); ``ffn_dtype`` the storage of the bundled FFN rows
    (fp32, bf16 or int8; with bf16 or int8 the predictors are held in bf16 too). Returns None
    when ``dense`` is set.
    """
    if dense:
        return None
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparseInferError("--device cuda: no CUDA device is available on this machine")
    cfg, model = loaded.config, loaded.model
    thresholds = layer_thresholds(loaded, threshold)
    oracle = loaded.metadata.get("sparseinfer.sparsity.layer_thresholds")
    counts = hot_counts(loaded, device, vram_budget, min_split)
    modules = []
    for i, block in enumerate(model.layers):
        ffn = block.ffn
        w_in = ffn.w_in.weight.float()
        gate, up = (w_in[: cfg.d_ff], w_in[cfg.d_ff:]) if ffn.gated else (None, w_in)
        up_bias = ffn.w_in.bias.float() if ffn.w_in.bias is not None else None
        down_bias = ffn.down.bias.float() if ffn.down.bias is not None else None
        packed = PackedFFN.from_dense(cfg.ffn_kind, gate, up, ffn.down.weight.float(),
                                      up_bias=up_bias, dtype=ffn_dtype)
        predictor = None
        if mode == "predictor":
            fc1, fc2 = _extra(loaded, "fc1.weight", i), _extra(loaded, "fc2.weight", i)
            if ffn_dtype != "fp32":  # smaller rows, smaller predictors: bf16 halves their bytes
                fc1, fc2 = fc1.bfloat16(), fc2.bfloat16()
            predictor = Predictor(fc1, fc2, thresholds[i],
                                  _extra(loaded, "fc2.bias", i, required=False))
        sparse = SparseFFN(packed, down_bias, predictor, mode=mode, n_hot=counts[i],
                           fast_device=dev,
                           oracle_threshold=float(oracle[i]) if isinstance(oracle, list) else 0.0,
                           split_tiers=split_tiers,
                           oracle_score=str(loaded.metadata.get("sparseinfer.sparsity.score",
                                                                "output")))
        block.ffn = sparse  # the dense module (and its weights) is released here
        modules.append(sparse)
    if dev.type != "cpu":
        model.to(dev)  # attention, norms, embeddings, LM head; cold FFN rows stay on the CPU
    log.info("sparse runtime: %d layers, mode %s, ffn %s, fast tier %s, %d hot neurons",
             len(modules), mode, ffn_dtype, dev, sum(counts))
    return SparseInfo(mode, ffn_dtype, str(dev), thresholds, counts, modules)


def use_kernels(loaded, ffn: bool = True) -> int:
    """Route single-token decode through the fused numba kernels, in place: bias-free fp32 CPU
    projections (attention, LM head) become ``KernelLinear`` (same weight tensor), and with
    ``ffn`` every dense FFN becomes a ``SparseFFN`` computing all neurons (mode "all").
    Outputs equal the torch path up to float reassociation. Returns the modules replaced."""
    from .kernels import KernelLinear

    model = loaded.model
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return 0
    n = 0

    def swap(owner, attr):
        nonlocal n
        lin = getattr(owner, attr)
        if isinstance(lin, torch.nn.Linear) and lin.bias is None and lin.weight.is_contiguous():
            setattr(owner, attr, KernelLinear(lin.weight))
            n += 1

    for block in model.layers:
        swap(block.attn, "wqkv")
        swap(block.attn, "wo")
    swap(model, "lm_head")
    if ffn and not isinstance(model.layers[0].ffn, SparseFFN):
        n += len(sparsify(loaded, mode="all").modules)
    return n
