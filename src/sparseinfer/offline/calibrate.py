"""Magnitude sparsity for non-ReLU FFNs (SwiGLU, GeGLU, GELU): per-neuron scores, per-layer
thresholds calibrated to a target density, and an oracle-masked FFN to measure what it costs.

A ReLU-family FFN (``FFNKind.relu_sparse``) has exact zeros: neuron i is active iff h_i != 0.
Other FFNs have none, so neuron i counts as active iff its *score* exceeds a per-layer threshold
t_l, chosen so that on a calibration corpus the mean share of active neurons is the target
density (CATS / TEAL, but scored by the neuron's contribution rather than by its gate alone):

    "gate"         |act_gate(gate_i · x)|              (CATS; ungated FFNs: |h_i|)
    "output"       |h_i|                               (the neuron's coefficient on down_i)
    "output_norm"  |h_i| · ||down_i||                   (the norm of the neuron's output vector)

``benchmarks/quality.py`` measures density against held-out perplexity for each score.

Thresholds are quantiles of all of a layer's scores (tokens × neurons). They are read off a
fine histogram of log2(score) (1/128 octave per bin, so memory does not grow with the corpus;
the quantile is interpolated inside its bin).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..errors import SparseInferError
from ..models.model import FFN, Transformer
from .defaults import DEFAULT_SCORE, DEFAULT_TARGET_DENSITY, SCORES  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


_LOG2_LO, _LOG2_HI, _BINS_PER_OCTAVE = -64.0, 32.0, 128


def check_score(score: str) -> str:
    if score not in SCORES:
        raise SparseInferError(f"score: expected one of {list(SCORES)}, got {score!r}")
    return score


def check_density(density: float, what: str = "target density") -> float:
    if not 0.0 < density <= 1.0:
        raise SparseInferError(f"{what}: expected a fraction in (0, 1], got {density}")
    return float(density)


def dense_weight(linear) -> Tensor:
    """The float32 weight of a projection module, whatever its storage (float, 4-bit, int8 or
    the file's own blocks)."""
    w = getattr(linear, "weight", None)
    return w.float() if isinstance(w, Tensor) else linear.dequantized()


def column_norms(linear, block_rows: int = 256) -> Tensor:
    """The norms of a projection's weight columns, (in_features,) fp32, a block of rows at a
    time: the file's quantized blocks are dequantized ``block_rows`` rows at once (gguf-py), so
    a 7B down projection never exists whole in float32 (180 MB)."""
    mats = getattr(linear, "mats", None)
    if mats and all(hasattr(m, "raw") for m in mats) and getattr(linear, "weight", None) is None:
        from gguf import GGMLQuantizationType, quants

        sq = np.zeros(mats[0].cols, dtype=np.float64)
        for m in mats:
            raw = m.file_rows()  # the file's rows (a view, or panels undone)
            qtype = GGMLQuantizationType[m.file_type]
            for r in range(0, m.rows, block_rows):
                w = quants.dequantize(raw[r: r + block_rows], qtype).reshape(-1, m.cols)
                sq += np.square(w, dtype=np.float64).sum(0)
        return torch.from_numpy(np.sqrt(sq).astype(np.float32))
    w = getattr(linear, "weight", None)
    if isinstance(w, Tensor):
        sq = torch.zeros(w.shape[1], dtype=torch.float64)
        for r in range(0, w.shape[0], block_rows):
            sq += w[r: r + block_rows].double().square().sum(0)
        return sq.sqrt().float()
    return linear.dequantized().norm(dim=0)  # 4-bit / int8 modules: small models only


def down_norms(ffn: FFN) -> Tensor:
    """||down_i|| for every neuron: the norms of the down projection's columns, (d_ff,) fp32."""
    return column_norms(ffn.down)


def neuron_scores(ffn: FFN, x: Tensor, h: Tensor, score: str,
                  norms: Tensor | None = None) -> Tensor:
    """Scores (..., d_ff) of the neurons of ``ffn`` for inputs ``x`` with coefficients ``h``."""
    if score == "output":
        return h.abs()
    if score == "output_norm":
        return h.abs() * (down_norms(ffn) if norms is None else norms)
    if score == "gate":
        if not ffn.gated:
            return h.abs()
        bias = None if ffn.w_in.bias is None else ffn.w_in.bias[: ffn.d_ff]
        gate = torch.nn.functional.linear(x.float(), dense_weight(ffn.w_in)[: ffn.d_ff], bias)
        return ffn.act_gate(gate).abs()
    raise SparseInferError(f"score: expected one of {list(SCORES)}, got {score!r}")


class ScoreHistogram:
    """Per-layer histograms of log2(score), for quantiles over tokens × neurons."""

    def __init__(self, n_layers: int):
        self.n_bins = int((_LOG2_HI - _LOG2_LO) * _BINS_PER_OCTAVE)
        self.counts = np.zeros((n_layers, self.n_bins), dtype=np.int64)
        self.zeros = np.zeros(n_layers, dtype=np.int64)  # scores that are exactly 0

    def add(self, layer: int, scores: Tensor) -> None:
        s = scores.detach().float().reshape(-1)
        zeros = int((s == 0).sum())
        self.zeros[layer] += zeros
        # log2(0) = -inf lands in bin 0 with the scores below 2**_LOG2_LO; taken out below
        lg = torch.log2(s).clamp_(_LOG2_LO, _LOG2_HI - 1e-6)
        bins = lg.sub_(_LOG2_LO).mul_(_BINS_PER_OCTAVE).to(torch.int64)
        hist = torch.bincount(bins, minlength=self.n_bins).numpy()
        hist[0] -= zeros
        self.counts[layer] += hist

    def threshold(self, layer: int, density: float) -> float:
        """Score t such that a share ``density`` of this layer's scores lies above t."""
        counts = self.counts[layer]
        total = int(counts.sum()) + int(self.zeros[layer])
        if total == 0:
            raise SparseInferError(f"layer {layer}: no scores recorded; expected a calibration "
                                   f"corpus of at least one token")
        below = (1.0 - density) * total - self.zeros[layer]  # scores to leave below t
        if below <= 0:
            return 0.0
        cum = np.cumsum(counts)
        b = int(np.searchsorted(cum, below))  # the bin holding the quantile
        b = min(b, self.n_bins - 1)
        before = cum[b - 1] if b > 0 else 0
        frac = (below - before) / max(counts[b], 1)
        lg = _LOG2_LO + (b + float(np.clip(frac, 0.0, 1.0))) / _BINS_PER_OCTAVE
        return float(2.0 ** lg)

    def thresholds(self, density: float) -> np.ndarray:
        check_density(density)
        return np.array([self.threshold(l, density) for l in range(len(self.counts))],
                        dtype=np.float32)


@contextlib.contextmanager
def hooked_ffns(model: Transformer,
                fn: Callable[[int, FFN, Tensor, Tensor], Tensor | None]) -> Iterator[None]:
    """Within the block, every FFN computes ``h`` then calls ``fn(layer, ffn, x, h)``; if that
    returns a tensor it replaces ``h`` before the down projection. model.py is not touched: the
    FFN modules' ``forward`` is overridden on the instances and restored afterwards."""
    saved = []
    try:
        for i, block in enumerate(model.layers):
            ffn = block.ffn

            def forward(x: Tensor, residual: Tensor | None = None, *, _i=i, _ffn=ffn) -> Tensor:
                h = _ffn.activations(x)
                new = fn(_i, _ffn, x, h)
                return _ffn.down(h if new is None else new)

            saved.append(ffn)
            ffn.forward = forward
        yield
    finally:
        for ffn in saved:
            del ffn.forward  # back to the class's forward


def run_chunks(model: Transformer, chunks: Sequence[Sequence[int]],
               progress: Callable[[int], None] | None = None) -> None:
    """Run every chunk through the layers (no LM head) as its own sequence from position 0."""
    longest = max(len(c) for c in chunks)
    cache = model.new_cache(1, longest)
    with torch.inference_mode():
        for c in chunks:
            model.hidden(torch.tensor([list(c)], dtype=torch.long), 0, cache)
            if progress:
                progress(len(c))


def calibrate_thresholds(model: Transformer, chunks: Sequence[Sequence[int]],
                         target_density: float, score: str = DEFAULT_SCORE,
                         progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Per-layer thresholds t_l (float32) so that a share ``target_density`` of the neurons'
    scores over ``chunks`` exceeds t_l."""
    check_density(target_density)
    check_score(score)
    hist = ScoreHistogram(model.cfg.n_layers)
    norms = {}

    def record(i, ffn, x, h):
        if score == "output_norm" and i not in norms:
            norms[i] = down_norms(ffn)
        hist.add(i, neuron_scores(ffn, x, h, score, norms.get(i)))

    with hooked_ffns(model, record):
        run_chunks(model, chunks, progress)
    return hist.thresholds(target_density)


@contextlib.contextmanager
def oracle_sparsity(model: Transformer, thresholds: Sequence[float] | None, score: str = "output",
                    densities: dict[int, list[float]] | None = None) -> Iterator[None]:
    """Within the block, each FFN keeps only neurons whose score exceeds its layer's threshold
    (``None``: ReLU-exact, h != 0 — a no-op on the output) — the oracle mask a perfect predictor
    would give. ``densities`` (if given) collects each call's active share per layer."""
    norms: dict[int, Tensor] = {}

    def mask(i, ffn, x, h):
        if thresholds is None:
            keep = h != 0
        else:
            if score == "output_norm" and i not in norms:
                norms[i] = down_norms(ffn)
            keep = neuron_scores(ffn, x, h, score, norms.get(i)) > float(thresholds[i])
        if densities is not None:
            densities.setdefault(i, []).append(float(keep.float().mean()))
        return h * keep

    with hooked_ffns(model, mask):
        yield
