"""What the sparse runtime built (``SparseInfo``) and the per-layer selector of a sparse GGUF.

The load plan (``models/plan.py``) decides the sparse layers; ``models/build.py`` builds them.
Tensors and keys read (written by ``offline/export.py``, documented in docs/sparse-gguf.md):
``blk.N.fc1.weight``, ``blk.N.fc2.weight`` (+ ``blk.N.fc2.bias``), ``blk.N.act_freq``,
``blk.N.gpu_idx``; ``powerinfer.sparse_threshold``, ``sparseinfer.predictor.thresholds``,
``sparseinfer.sparsity.layer_thresholds``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .ffn import BATCH_MODES, AllNeurons, Oracle, Predicted, Predictor, Selector, SparseFFN

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class SparseInfo:
    """What the sparse runtime did to a model (shown by the CLI, used by benchmarks)."""

    mode: str
    ffn_dtype: str  # the rows' storage ("int8 + q4 gates": with the file's gate rows apart)
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
        """"auto" (the default: where the C kernels take the rows (Q4_0, int8), every token of
        a prompt or a batched step its own set, as "masked"; other rows as
        measured by benchmarks/prefill.py: "union" up to ``ffn.UNION_MAX_TOKENS`` tokens and at
        any length for bf16 rows, else "dense"; with a dense copy of the FFN, ``DenseCopy``,
        that copy), "dense" (every neuron; the dense copy's where there is one), "union" (the union of
        the tokens' predicted sets, batched-sparse kernel) or "masked" (each token its own
        active set, as decoding it alone: in the C kernels where they take the rows, as
        "auto", else torch; the perplexity of the sparse model)."""
        if mode not in BATCH_MODES:
            raise ValueError(f"batch mode: expected one of {list(BATCH_MODES)}, got {mode!r}")
        for m in self.modules:
            m.batch_mode = mode

    def reset_stats(self) -> None:
        for m in self.modules:
            m.stats.tokens = m.stats.active = 0


def sparse_info(model, plan) -> SparseInfo | None:
    """The ``SparseInfo`` of a model built from ``plan`` (None: no sparse layers)."""
    sp = plan.sparse
    if sp is None:
        return None
    modules = [b.ffn for b in model.layers if isinstance(b.ffn, SparseFFN)]
    rows = sp.ffn_dtype + sp.q4_rows_note(" + ")
    return SparseInfo(sp.selector, rows, sp.device, list(sp.thresholds),
                      list(sp.hot_counts), modules)


def make_selector(sp, layer: int) -> Selector:
    """The selector of one layer, as the plan ``sp`` says (a ``Predicted`` is built empty: its
    weights come with ``predictor_of``)."""
    if sp.selector == "all":
        return AllNeurons()
    if sp.selector == "oracle":
        return Oracle(sp.oracle_thresholds[layer], sp.oracle_score)
    return Predicted(on_residual=sp.predictor_input == "residual",
                     threshold=sp.thresholds[layer])


def predictor_of(sp, layer: int, extra) -> Predictor:
    """Layer ``layer``'s predictor from the file; ``extra(name)`` reads a non-model tensor."""
    fc1, fc2 = extra(f"blk.{layer}.fc1.weight"), extra(f"blk.{layer}.fc2.weight")
    if sp.ffn_dtype == "q4" or (sp.ffn_dtype == "int8" and fc1.shape[1] % 32 == 0):
        # rows that run in the C library: its float16 predictor kernel, on the same thread pool
        fc1, fc2 = fc1.half(), fc2.half()
    elif sp.ffn_dtype != "fp32":  # smaller rows, smaller predictors: bf16 halves their bytes
        fc1, fc2 = fc1.bfloat16(), fc2.bfloat16()
    return Predictor(fc1, fc2, sp.thresholds[layer], extra(f"blk.{layer}.fc2.bias"))
