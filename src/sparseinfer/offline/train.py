"""Train the per-layer activation predictors  p_l(x) = fc2 · relu(fc1 · x) + b  on a profile.

Each layer's profiled tokens are split in three contiguous stretches: train (80%), val (10%),
test (10%). A predictor is fitted on train with binary cross-entropy against the active masks
for at least ``min_steps`` (1000) Adam steps on a one-cycle schedule (torch on CPU). Its
decision threshold τ is then chosen on val so that the share of truly active neurons predicted
(recall) reaches the target, and folded into the bias (b ← b − τ): a neuron is predicted
active iff its logit is >= 0 (PowerInfer's ``sparse_threshold``). Recall, precision and
predicted density are reported on test, which neither the fit nor the threshold saw.

Why this loss. For a fixed predicted density, recall is highest when the (token, neuron) pairs
are ranked by P(active | x) (Neyman-Pearson), which is what BCE estimates, so one τ per layer
on calibrated logits is the right decision rule. Losses aimed at the tail or at the score
itself did not rank better (below); what helped was training longer: 300 steps (the former
default, ≈ 6 epochs of a 16k-token profile) left the predictors under-trained.

Rank. Candidate ranks are tried from small to large (capped so the predictor stays within
``max_param_share`` of the layer's FFN parameters). The first rank that meets both targets —
recall >= ``recall`` at a predicted density <= ``max_density_ratio`` × the true density — is
kept. Otherwise the rank grows only while it pays: once doubling the rank lowers the val density
at the target recall by less than ``min_gain``, the smaller rank is kept (fewest parameters for
the quality the rank family reaches). Whether doubling pays is first asked of a short probe
(``probe_steps``, 250) that starts from the smaller predictor with the new hidden units' output
weights at zero; only a rank whose probe pays is fitted in full, from scratch like the first, so
every predictor kept is a full fit. On SmolLM2 the probes chose the ranks the full fits chose on
every layer (benchmarks/RESULTS.md) in two thirds of the training time: most layers stop at the
first rank. Layers train side by side, one per core (``train_predictors``).

When the targets cannot both be met (magnitude-thresholded SwiGLU masks: the neurons just above
the threshold are hard to tell from those just below), ``policy`` decides: "recall" keeps the
recall target (the predicted density is what it is); "density" caps the predicted density at
``max_density_ratio`` × the true density (the recall is what it is).

Measurements (SmolLM2-135M, "output" score at target density 0.5, layers 0 / 15 / 29, rank
125 (≈ the 10% cap, 124) unless said, predicted density at recall 0.99 on the test split; scratch
scripts, not shipped):

- former defaults (BCE, 300 steps, 16k-token profile): 0.787 / 0.965 / 0.921;
- BCE, 1000 steps, pos_weight 3: 0.722 / 0.965 / 0.905; 2000 steps, unweighted: 0.705 / 0.966 /
  0.908 (pos_weight 3 at 2000: – / 0.965 / 0.901);
- regression of the score instead of the mask (Huber on clip(ln(score / t_l), ±3)) at 300
  steps: 0.808 / 0.966 / 0.924, at 2000: – / 0.969 / –; BCE + regression: – / 0.969 / –;
  focal loss (γ 2): – / 0.964 / 0.901; none beats BCE;
- a 64k-token profile (6 min to profile instead of 1.5, 2.3 GB): 0.690 / 0.964 / 0.909 at
  2000 steps — within 0.015 of 16k, not worth 4x the profile;
- lr 1e-3 / 1e-2, weight decay, per-dimension scaling of x, fc1 initialised from the gate/up
  weights' principal directions, per-neuron Platt recalibration on val: all within ±0.002;
- rank 576 and 1536 (5x and 12x over the cap) on layer 15: 0.967 / 0.965 — the rank is not
  what limits it.

The target (density <= 0.75 at recall 0.99) is met only by layer 0. Everything measured says
it is out of reach of a predictor that sees x through a rank-125 bottleneck: knowing the exact
gate pre-activations of all 1536 neurons (full rank) and only the mean |up| still needs density
0.79 / 0.83 / 0.80 at recall 0.99, the exact up pre-activations alone 0.83 / 0.76 / 0.81, and
ranking by |silu(g)·u| of the best rank-125 linear reconstruction of both (82–97% of their
variance) needs 0.99: whether |silu(g)·u| lands above or below t_l depends on both projections
of every neuron precisely. With the rank rule above, most SmolLM2 layers keep rank 16 (each
doubling gains < ``min_gain``): 0.92–0.97 predicted density on layers 1–29 where rank 124
would give 0.89–0.97, at 8x the predictor cost.

ReLU-family masks (exact zeros) are another matter: on a ReGLU llama trained here on Austen
(``benchmarks/relu_predictors.py --d-model 512 --d-ff 2048``) the same method meets both targets
on every layer — recall 0.99 at 1.15–1.40x the true density with ranks 16–32 (2.3% of the FFN's
parameters) — and the sparse model's held-out perplexity equals the dense one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import FFN_KINDS
from ..errors import SparseInferError
from ..fileio import read_npz
from .profile import Profile

log = logging.getLogger(__name__)

PREDICTORS_FORMAT = "sparseinfer-predictors"
PREDICTORS_VERSION = 1
POLICIES = ("recall", "density")
MIN_SPLIT_TOKENS = 16  # val and test each need at least this many tokens


@dataclass(frozen=True)
class TrainOptions:
    recall: float = 0.99  # target recall on held-out tokens
    max_density_ratio: float = 1.5  # predicted density <= this × true density
    policy: str = "recall"  # which target wins when both cannot be met
    ranks: tuple[int, ...] = (16, 32, 64, 128)  # candidates, smallest first
    max_param_share: float = 0.10  # predictor parameters <= this share of the FFN's
    min_gain: float = 0.01  # grow the rank only while val density drops by at least this
    epochs: int = 6
    # at least this many Adam steps whatever the profile size (≈ 20 epochs of the default
    # 16,384-token profile): 300 steps left the predictors under-trained (module docstring)
    min_steps: int = 1000
    # a larger rank is first tried as a probe of this many steps that starts from the smaller
    # rank's predictor; only when the probe pays is the rank fitted in full (0: fit every
    # candidate in full). On SmolLM2 most layers stop at the first rank: a third less training
    probe_steps: int = 250
    batch_size: int = 256
    lr: float = 3e-3
    # BCE weight of active neurons (the threshold sets the recall anyway; 3 gained <= 0.007 of
    # density on SmolLM2 and made the density policy's cap transfer worse from val to test)
    pos_weight: float = 1.0
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    max_train_tokens: int = 0  # 0 = every training token
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.recall <= 1.0:
            raise SparseInferError(f"recall: expected a fraction in (0, 1], got {self.recall}")
        if self.max_density_ratio < 1.0:
            raise SparseInferError(f"max density ratio: expected >= 1, got "
                                   f"{self.max_density_ratio}")
        if self.policy not in POLICIES:
            raise SparseInferError(f"policy: expected one of {list(POLICIES)}, got {self.policy!r}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise SparseInferError(f"ranks: expected positive integers, got {self.ranks}")
        if self.probe_steps < 0:
            raise SparseInferError(f"probe steps: expected >= 0, got {self.probe_steps}")
        if self.epochs < 1 or self.min_steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise SparseInferError(f"optimisation: expected epochs >= 1, min_steps >= 0, "
                                   f"batch_size >= 1, lr > 0, got {self.epochs}, "
                                   f"{self.min_steps}, {self.batch_size}, {self.lr}")
        if self.pos_weight <= 0:
            raise SparseInferError(f"pos weight: expected > 0, got {self.pos_weight}")
        if not 0.0 < self.max_param_share <= 1.0:
            raise SparseInferError(f"max param share: expected a fraction in (0, 1], got "
                                   f"{self.max_param_share}")
        if not (0 < self.val_fraction < 1 and 0 <= self.test_fraction < 1
                and self.val_fraction + self.test_fraction < 0.9):
            raise SparseInferError(f"val/test fractions: expected 0 < val, 0 <= test, "
                                   f"val + test < 0.9, got {self.val_fraction}, "
                                   f"{self.test_fraction}")


@dataclass(frozen=True)
class LayerPredictor:
    layer: int
    fc1: np.ndarray = field(repr=False)  # (r, d_model) float32
    fc2: np.ndarray = field(repr=False)  # (d_ff, r) float32
    bias: np.ndarray = field(repr=False)  # (d_ff,) float32, decision threshold folded in
    threshold: float  # τ subtracted from the trained bias
    true_density: float  # test split
    pred_density: float
    recall: float
    precision: float
    met_targets: bool  # recall and density targets both met on val
    tried: tuple[tuple[int, float], ...]  # (rank, val density at the target recall)
    seconds: float

    @property
    def rank(self) -> int:
        return int(self.fc1.shape[0])

    @property
    def n_params(self) -> int:
        return int(self.fc1.size + self.fc2.size + self.bias.size)


@dataclass(frozen=True)
class Predictors:
    layers: tuple[LayerPredictor, ...]
    options: TrainOptions
    ffn_params: int  # parameters of one layer's FFN (for the share)
    n_test_tokens: int

    @property
    def n_params(self) -> int:
        return sum(p.n_params for p in self.layers)

    @property
    def param_share(self) -> float:
        return self.n_params / max(self.ffn_params * len(self.layers), 1)


def ffn_param_count(kind: str, d_model: int, d_ff: int) -> int:
    """Weights of one FFN: gate + up + down (gated) or up + down and their biases (ungated)."""
    if FFN_KINDS[kind].gated:
        return 3 * d_model * d_ff
    return 2 * d_model * d_ff + d_ff + d_model


def rank_cap(kind: str, d_model: int, d_ff: int, share: float) -> int:
    """Largest rank whose fc1 + fc2 + bias stays within ``share`` of the FFN's parameters."""
    return int((share * ffn_param_count(kind, d_model, d_ff) - d_ff) // (d_model + d_ff))


def candidate_ranks(options: TrainOptions, kind: str, d_model: int, d_ff: int) -> list[int]:
    cap = rank_cap(kind, d_model, d_ff, options.max_param_share)
    if cap < 1:
        raise SparseInferError(
            f"predictor budget: expected room for a rank-1 predictor within "
            f"{options.max_param_share:.0%} of the FFN's parameters, found none "
            f"(d_model {d_model}, d_ff {d_ff})")
    return sorted({min(r, cap) for r in options.ranks})


# ---- one layer ---------------------------------------------------------------------------------


class _Predictor(torch.nn.Module):
    def __init__(self, d_model: int, rank: int, d_ff: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_model, rank, bias=False)
        self.fc2 = torch.nn.Linear(rank, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _fit(x: torch.Tensor, y: torch.Tensor, rank: int, opt: TrainOptions, seed: int,
         start: _Predictor | None = None) -> _Predictor:
    """Adam on a one-cycle schedule, minibatches of ``opt.batch_size`` drawn without
    replacement per epoch. The gradient of the mean BCE is written out by hand (``_bce_grads``):
    autograd's BCE-with-logits spent most of each step in a dozen elementwise passes over the
    (batch, d_ff) logits, where the hand-written step makes two.

    ``start`` (a trained predictor of a smaller rank): a probe of ``opt.probe_steps`` steps that
    begins from it, its hidden units kept and the new ones' output weights zero (so it starts
    at ``start``'s logits)."""
    d, f = x.shape[1], y.shape[1]
    gen = torch.Generator().manual_seed(seed)  # not the global one: layers train side by side
    # nn.Linear's initial distribution, U(±1/sqrt(fan_in)); fc2 trained transposed, [rank, d_ff]
    w1 = torch.empty(rank, d).uniform_(-d ** -0.5, d ** -0.5, generator=gen)
    w2t = torch.empty(rank, f).uniform_(-rank ** -0.5, rank ** -0.5, generator=gen)
    b2 = torch.empty(f).uniform_(-rank ** -0.5, rank ** -0.5, generator=gen)
    n = x.shape[0]
    bs = min(opt.batch_size, n)
    steps_per_epoch = max(n // bs, 1)
    steps = max(opt.epochs * steps_per_epoch, opt.min_steps, 20)  # one-cycle needs a few
    if start is not None:
        k = start.fc1.weight.shape[0]
        with torch.no_grad():
            w1[:k] = start.fc1.weight
            w2t.zero_()
            w2t[:k] = start.fc2.weight.T
            b2.copy_(start.fc2.bias)
        steps = max(opt.probe_steps, 20)
    # fused: one kernel per step instead of a dozen small ops per parameter (a third of a
    # rank-16 step went to the unfused update)
    adam = torch.optim.Adam([w1, w2t, b2], lr=opt.lr, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(adam, max_lr=opt.lr, total_steps=steps,
                                                pct_start=0.1)
    step = 0
    with torch.no_grad():
        while step < steps:
            perm = torch.randperm(n, generator=gen)
            for s in range(steps_per_epoch):
                if step >= steps:
                    break
                idx = perm[s * bs:(s + 1) * bs]
                w1.grad, w2t.grad, b2.grad = _bce_grads(
                    x.index_select(0, idx).float(), y.index_select(0, idx).float(), w1, w2t,
                    b2, opt.pos_weight)
                adam.step()
                sched.step()
                step += 1
    net = _Predictor(d, rank, f)
    with torch.no_grad():
        net.fc1.weight.copy_(w1)
        net.fc2.weight.copy_(w2t.T)
        net.fc2.bias.copy_(b2)
    return net.eval()


def _bce_grads(xb: torch.Tensor, yb: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor,
               b2: torch.Tensor, pos_weight: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fc1, fc2 transposed, fc2 bias) of ``binary_cross_entropy_with_logits(
    relu(x w1ᵀ) w2t + b2, y, pos_weight)`` averaged over every element: dL/dz = (σ(z)(1 +
    (w-1)y) - w·y) / (B·F)."""
    h = torch.relu(xb @ w1.T)  # (B, r)
    g = torch.addmm(b2, h, w2t).sigmoid_()  # (B, F): σ(z)
    if pos_weight != 1.0:
        g.mul_(yb * (pos_weight - 1.0) + 1.0)
        g.sub_(yb, alpha=pos_weight)
    else:
        g.sub_(yb)
    scale = 1.0 / g.numel()
    g_w2t = (h.T @ g).mul_(scale)
    g_b2 = g.sum(0).mul_(scale)
    dh = (g @ w2t.T).mul_(h > 0)
    g_w1 = (dh.T @ xb).mul_(scale)
    return g_w1, g_w2t, g_b2


def _logits(net: _Predictor, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([net(x[i:i + 4096].float()) for i in range(0, x.shape[0], 4096)])


def recall_threshold(logits: torch.Tensor, y: torch.Tensor, recall: float) -> float:
    """The largest τ with share(logit >= τ | active) >= recall."""
    pos = logits[y]
    if pos.numel() == 0:
        return float("inf")
    k = int(np.floor((1.0 - recall) * pos.numel()))  # positives that may fall below τ
    return float(torch.kthvalue(pos.flatten(), k + 1).values) if k > 0 else float(pos.min())


def density_threshold(logits: torch.Tensor, density: float) -> float:
    """τ with share(logit >= τ) ≈ ``density`` (at most)."""
    flat = logits.flatten()
    keep = int(np.floor(density * flat.numel()))
    if keep >= flat.numel():
        return float(flat.min())
    if keep <= 0:
        return float("inf")
    return float(torch.kthvalue(flat, flat.numel() - keep + 1).values)  # the keep-th largest


def classify(logits: torch.Tensor, y: torch.Tensor, tau: float) -> tuple[float, float, float]:
    """(recall, precision, predicted density) of ``logits >= tau`` against ``y``."""
    pred = logits >= tau
    tp = int((pred & y).sum())
    n_pos, n_pred = int(y.sum()), int(pred.sum())
    recall = tp / n_pos if n_pos else 1.0
    precision = tp / n_pred if n_pred else 1.0
    return recall, precision, n_pred / max(pred.numel(), 1)


def train_layer(layer: int, x: torch.Tensor, y: torch.Tensor, splits: tuple[int, int],
                ranks: list[int], opt: TrainOptions) -> LayerPredictor:
    """Fit, pick the rank and threshold, evaluate. ``x`` (T, d) float16 or float32, ``y``
    (T, d_ff) bool, ``splits`` = (end of train, end of val); test is the rest (or val when
    empty)."""
    t0 = time.perf_counter()
    a, b = splits
    x_tr, y_tr = x[:a], y[:a]
    if opt.max_train_tokens and a > opt.max_train_tokens:
        x_tr, y_tr = x_tr[:opt.max_train_tokens], y_tr[:opt.max_train_tokens]
    x_va, y_va = x[a:b], y[a:b]
    x_te, y_te = (x[b:], y[b:]) if b < x.shape[0] else (x_va, y_va)
    cap = opt.max_density_ratio * float(y_va.float().mean())
    seed = opt.seed * 1000 + layer

    def fit(r: int, start: _Predictor | None = None):
        net = _fit(x_tr, y_tr, r, opt, seed, start)
        lg = _logits(net, x_va)
        return net, lg, classify(lg, y_va, recall_threshold(lg, y_va, opt.recall))[2]

    tried: list[tuple[int, float]] = []  # (rank, val density) of each full fit
    best = fit(ranks[0])  # (net, val logits, val density at the target recall)
    tried.append((ranks[0], best[2]))
    for r in ranks[1:]:
        if best[2] <= cap:
            break  # both targets met
        # does doubling the rank pay? A short probe from the current predictor says; only a
        # rank that pays is fitted in full (from scratch, as the first)
        if opt.probe_steps:
            dens = fit(r, best[0])[2]
            log.debug("layer %d: rank %d probe, val density %.4f (rank %d: %.4f)", layer, r,
                      dens, best[0].fc1.weight.shape[0], best[2])
            if dens > cap and best[2] - dens < opt.min_gain:
                break  # the larger rank does not pay: keep the smaller one
        cand = fit(r)
        tried.append((r, cand[2]))
        if cand[2] > cap and best[2] - cand[2] < opt.min_gain:
            break
        best = cand
    net, lg, dens = best
    met = dens <= cap
    tau = recall_threshold(lg, y_va, opt.recall)
    if not met and opt.policy == "density":
        tau = density_threshold(lg, cap)
    recall, precision, pred_density = classify(_logits(net, x_te), y_te, tau)
    fc1 = net.fc1.weight.detach().numpy().astype(np.float32)
    fc2 = net.fc2.weight.detach().numpy().astype(np.float32)
    bias = (net.fc2.bias.detach() - tau).numpy().astype(np.float32)
    return LayerPredictor(
        layer=layer, fc1=fc1, fc2=fc2, bias=bias, threshold=tau,
        true_density=float(y_te.float().mean()), pred_density=pred_density, recall=recall,
        precision=precision, met_targets=met, tried=tuple(tried),
        seconds=time.perf_counter() - t0,
    )


# ---- all layers --------------------------------------------------------------------------------


def split_points(n_tokens: int, opt: TrainOptions) -> tuple[int, int]:
    """(end of train, end of val) for contiguous train / val / test stretches."""
    n_val = int(n_tokens * opt.val_fraction)
    n_test = int(n_tokens * opt.test_fraction)
    if n_val < MIN_SPLIT_TOKENS or (opt.test_fraction > 0 and n_test < MIN_SPLIT_TOKENS) or \
            n_tokens - n_val - n_test < 2 * MIN_SPLIT_TOKENS:
        need = int(np.ceil(MIN_SPLIT_TOKENS / min(opt.val_fraction,
                                                  opt.test_fraction or opt.val_fraction)))
        raise SparseInferError(
            f"profile too small to train predictors: expected at least {need} tokens (so that "
            f"val and test hold {MIN_SPLIT_TOKENS} each), found {n_tokens}")
    a = n_tokens - n_val - n_test
    return a, a + n_val


def train_predictors(profile: Profile, options: TrainOptions = TrainOptions(),
                     progress: Callable[[int], None] | None = None,
                     layers: list[int] | None = None, workers: int | None = None) -> Predictors:
    """Train one predictor per layer of ``profile`` (``progress(1)`` after each layer).

    ``workers`` layers train at once (default: torch's thread count), each on one thread: a
    step's ops are too small to split well across threads (each split wakes the pool), so
    whole layers side by side keep every core busy. Each layer's result depends only on its
    data and seed, not on which worker trained it."""
    splits = split_points(profile.n_tokens, options)
    ranks = candidate_ranks(options, profile.ffn_kind, profile.d_model, profile.d_ff)
    todo = list(range(profile.n_layers) if layers is None else layers)
    workers = max(1, min(workers or torch.get_num_threads(), len(todo)))

    def one(l: int) -> LayerPredictor:
        # as stored (float16 inputs, bool masks), each minibatch made float32 as it is drawn:
        # a worker holds T · (2 · d_model + d_ff) bytes
        x = torch.from_numpy(np.array(profile.inputs(l)))
        y = torch.from_numpy(profile.masks(l))
        p = train_layer(l, x, y, splits, ranks, options)
        log.info("layer %d: rank %d, recall %.4f, precision %.3f, density %.3f (true %.3f), "
                 "%.1f s", l, p.rank, p.recall, p.precision, p.pred_density, p.true_density,
                 p.seconds)
        return p

    done: dict[int, LayerPredictor] = {}
    if workers == 1:  # one layer at a time, on all of torch's threads
        for l in todo:
            done[l] = one(l)
            if progress:
                progress(1)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # each worker's ops on its own thread
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="train") as pool:
                futures = {pool.submit(one, l): l for l in todo}
                try:
                    for f in as_completed(futures):
                        done[futures[f]] = f.result()
                        if progress:
                            progress(1)
                except BaseException:  # an error or Ctrl-C: start no further layer
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            torch.set_num_threads(threads)
    return Predictors(tuple(done[l] for l in todo), options,
                      ffn_param_count(profile.ffn_kind, profile.d_model, profile.d_ff),
                      profile.n_tokens - splits[1] if options.test_fraction > 0
                      else splits[1] - splits[0])


def evaluate_predictors(preds: Predictors, profile: Profile) -> list[tuple[float, float, float,
                                                                         float]]:
    """Per layer (recall, precision, predicted density, true density) of ``preds`` on every
    token of ``profile`` (e.g. a profile of held-out text made with the same thresholds)."""
    check_matches(preds, profile)
    out = []
    for p in preds.layers:
        x = torch.from_numpy(np.array(profile.inputs(p.layer), dtype=np.float32))
        y = torch.from_numpy(profile.masks(p.layer))
        with torch.no_grad():
            lg = torch.relu(x @ torch.from_numpy(p.fc1).T) @ torch.from_numpy(p.fc2).T
            lg += torch.from_numpy(p.bias)
        recall, precision, dens = classify(lg, y, 0.0)
        out.append((recall, precision, dens, float(y.float().mean())))
    return out


# ---- file --------------------------------------------------------------------------------------

_METRICS = ("threshold", "true_density", "pred_density", "recall", "precision", "seconds")


def save_predictors(path: str | Path, preds: Predictors) -> None:
    """Write predictors as an .npz (no pickles); replaces the file atomically."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {
        "format": np.array(PREDICTORS_FORMAT), "version": np.array(PREDICTORS_VERSION),
        "layers": np.array([p.layer for p in preds.layers], dtype=np.int64),
        "met_targets": np.array([p.met_targets for p in preds.layers], dtype=bool),
        "options": np.array(json.dumps(asdict(preds.options))),
        "info": np.array([preds.ffn_params, preds.n_test_tokens], dtype=np.int64),
        "tried": np.array(json.dumps([p.tried for p in preds.layers])),
    }
    for m in _METRICS:
        arrays[m] = np.array([getattr(p, m) for p in preds.layers], dtype=np.float64)
    for p in preds.layers:
        arrays[f"fc1_{p.layer}"], arrays[f"fc2_{p.layer}"] = p.fc1, p.fc2
        arrays[f"bias_{p.layer}"] = p.bias
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SparseInferError(f"{path}: cannot write predictors: {e.strerror or e}") from None
    log.info("wrote %d predictors to %s", len(preds.layers), path)


def load_predictors(path: str | Path) -> Predictors:
    path = Path(path)
    a = read_npz(path, "a predictors .npz written by `sparseinfer train-predictors`")
    if str(a.get("format", "")) != PREDICTORS_FORMAT or int(a.get("version", -1)) != \
            PREDICTORS_VERSION:
        raise SparseInferError(f"{path}: expected format {PREDICTORS_FORMAT!r} version "
                               f"{PREDICTORS_VERSION}, found {str(a.get('format', ''))!r}")
    try:
        opts = json.loads(str(a["options"]))
        opts["ranks"] = tuple(opts["ranks"])
        tried = json.loads(str(a["tried"]))
        layers = []
        for i, l in enumerate(a["layers"].tolist()):
            layers.append(LayerPredictor(
                layer=l, fc1=a[f"fc1_{l}"], fc2=a[f"fc2_{l}"], bias=a[f"bias_{l}"],
                met_targets=bool(a["met_targets"][i]),
                tried=tuple((int(r), float(d)) for r, d in tried[i]),
                **{m: float(a[m][i]) for m in _METRICS}))
        ffn_params, n_test = (int(v) for v in a["info"])
        return Predictors(tuple(layers), TrainOptions(**opts), ffn_params, n_test)
    except (KeyError, TypeError, ValueError) as e:
        raise SparseInferError(f"{path}: incomplete or corrupt predictors file: {e!r}") from None


def check_matches(preds: Predictors, profile: Profile) -> None:
    """Predictors must cover every layer of the profile with matching shapes."""
    if [p.layer for p in preds.layers] != list(range(profile.n_layers)):
        raise SparseInferError(f"predictors: expected layers 0..{profile.n_layers - 1}, found "
                               f"{[p.layer for p in preds.layers]}")
    for p in preds.layers:
        if p.fc1.shape[1] != profile.d_model or p.fc2.shape[0] != profile.d_ff:
            raise SparseInferError(
                f"predictor of layer {p.layer}: expected fc1 [r, {profile.d_model}] and fc2 "
                f"[{profile.d_ff}, r], found {list(p.fc1.shape)} and {list(p.fc2.shape)}")
