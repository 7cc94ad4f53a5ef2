"""Placement solver: which of each layer's hottest FFN neurons live on the fast tier.

An integer linear program solved by HiGHS (through ``scipy.optimize.milp``), after PowerInfer:
maximise the activation mass (the sum of activation frequencies) held on the fast tier, subject to

* the byte budget: the dense parts (embeddings, KV cache, attention, predictors, norms, ...) are
  charged first, in the order given; the neurons share what is left;
* a per-layer minimum: a layer split across tiers must keep at least ``min_split_neurons`` of its
  neurons on the fast tier, enough to pay for the synchronisation a split costs. Layers with no
  fast neurons, and layers entirely on the fast tier, are not split.

Model. Within a layer every neuron costs the same bytes, so the best fast set of a given size is
the hottest neurons: a prefix of the layer's neurons sorted by descending frequency. The prefix is
cut into groups of ``group_size`` (the last one may be partial; it carries its true size and
mass). The groups that reach the per-layer minimum are merged into one leading *block*, so every
layer is a chain of blocks ``0..B_l-1`` with one binary variable each::

    maximise    sum_{l,b} mass_{l,b} x_{l,b}
    subject to  sum_{l,b} bytes_{l,b} x_{l,b} <= budget - dense_bytes
                x_{l,b+1} <= x_{l,b}                        (hottest first: a prefix of blocks)
                x_{l,b} in {0, 1}

``x_{l,0}`` is PowerInfer's "layer has fast neurons" indicator ``y_l``; merging the groups below
the minimum into it is the tightest form of ``count_l >= min(min_split, d_ff_l) * y_l``. A fully
fast layer holds ``d_ff_l >= min(min_split, d_ff_l)`` neurons, so it meets the minimum by itself
and needs no special case.

Solving. Because frequencies are sorted, each layer's mass per byte falls from block to block, so
the LP relaxation is a fractional knapsack, almost integral. Before HiGHS runs, a greedy fill
gives a feasible placement and reduced-cost fixing against it (see ``_fixings``) decides every
block far from the cut, which leaves HiGHS a few hundred to a few thousand free binaries. HiGHS
runs with presolve off: on these chains its presolve spends 10-20 s and removes nothing. The byte
row is divided by the gcd of all block costs (exact for integers) to keep coefficients small, and
the rounded solution is re-checked in exact integer arithmetic (``_repair``). On a 70B-shaped
instance (80 x 28,672 neurons, 35,600 blocks) the whole solve takes about a second.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import SparseInferError
from ..fileio import read_npz

logger = logging.getLogger(__name__)

__all__ = [
    "PlacementProblem",
    "PlacementSolution",
    "solve_placement",
    "save_placement",
    "load_placement",
]

PLACEMENT_FORMAT = "sparseinfer-placement"
PLACEMENT_VERSION = 1


def _as_int(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SparseInferError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise SparseInferError(f"{what}: expected an integer >= {minimum}, got {int(value)}")
    return int(value)


@dataclass(frozen=True)
class PlacementProblem:
    """One placement instance. Validated and normalised on construction."""

    freqs: tuple[np.ndarray, ...]  # per layer: activation frequency of each FFN neuron, in [0, 1]
    neuron_bytes: tuple[int, ...]  # per layer: fast-tier bytes of one neuron (gate+up+down rows)
    budget_bytes: int  # fast-tier budget (VRAM, or RAM when the cold tier is disk)
    dense_parts: tuple[tuple[str, int], ...] = ()  # (name, bytes), charged first, in this order
    group_size: int = 64
    min_split_neurons: int = 256  # a split layer keeps at least this many fast (clipped to d_ff)

    def __post_init__(self) -> None:
        if len(self.freqs) == 0:
            raise SparseInferError("freqs: expected at least one layer, got none")
        freqs = []
        for i, f in enumerate(self.freqs):
            try:
                a = np.array(f, dtype=np.float64)  # a private copy
            except (TypeError, ValueError) as e:
                raise SparseInferError(
                    f"freqs[{i}]: expected an array of neuron frequencies, got {type(f).__name__}"
                ) from e
            if a.ndim != 1 or a.size == 0:
                raise SparseInferError(
                    f"freqs[{i}]: expected a non-empty 1-D array of neuron frequencies, "
                    f"got shape {a.shape}"
                )
            bad = ~((a >= 0.0) & (a <= 1.0))  # also catches NaN
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                raise SparseInferError(
                    f"freqs[{i}]: expected frequencies in [0, 1], found {a[j]!r} at neuron {j} "
                    f"({int(bad.sum())} out of range)"
                )
            a.setflags(write=False)
            freqs.append(a)
        if len(self.neuron_bytes) != len(freqs):
            raise SparseInferError(
                f"neuron_bytes: expected one entry per layer ({len(freqs)} layers), "
                f"got {len(self.neuron_bytes)}"
            )
        nb = tuple(
            _as_int(b, f"neuron_bytes[{i}]", minimum=1) for i, b in enumerate(self.neuron_bytes)
        )
        dense = []
        for i, part in enumerate(self.dense_parts):
            pair = isinstance(part, (tuple, list)) and len(part) == 2
            if not (pair and isinstance(part[0], str)):
                raise SparseInferError(
                    f"dense_parts[{i}]: expected a (name, bytes) pair, got {part!r}"
                )
            name = part[0]
            dense.append((name, _as_int(part[1], f"dense_parts[{i}] ({name})", minimum=0)))
        normalised = {
            "freqs": tuple(freqs),
            "neuron_bytes": nb,
            "dense_parts": tuple(dense),
            "budget_bytes": _as_int(self.budget_bytes, "budget_bytes", minimum=0),
            "group_size": _as_int(self.group_size, "group_size", minimum=1),
            "min_split_neurons": _as_int(self.min_split_neurons, "min_split_neurons", minimum=0),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def d_ff(self) -> tuple[int, ...]:
        return tuple(int(f.size) for f in self.freqs)

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense_parts)

    @property
    def neuron_total_bytes(self) -> int:
        """Bytes of every FFN neuron of every layer (all of them on the fast tier)."""
        return sum(d * b for d, b in zip(self.d_ff, self.neuron_bytes))


@dataclass(frozen=True)
class PlacementSolution:
    """A placement: the fast-tier neurons of every layer, and what they cost and hold."""

    hot: tuple[np.ndarray, ...]  # per layer: int64 fast-tier neuron indices, hottest first
    hot_counts: tuple[int, ...]
    fast_bytes: int  # dense parts + hot neurons; never > budget
    dense_bytes: int
    objective: float  # activation mass (sum of freqs) on the fast tier
    total_mass: float
    status: str  # "optimal" (within mip_rel_gap) | "time_limit" | "greedy" | "feasible"; all fit
    solve_seconds: float
    # Added context (defaults keep the constructor above valid on its own):
    d_ff: tuple[int, ...] = ()
    neuron_bytes: tuple[int, ...] = ()
    hot_mass: tuple[float, ...] = ()  # per layer: mass on the fast tier
    layer_mass: tuple[float, ...] = ()  # per layer: total mass
    budget_bytes: int = 0
    dense_parts: tuple[tuple[str, int], ...] = ()
    mip_gap: float = 0.0  # (best upper bound - objective) / objective; 0 = proven optimal

    def summary_rows(self) -> list[dict]:
        """One dict per layer: layer, d_ff, hot_count, hot_mass_share, hot_bytes."""
        rows = []
        for l, count in enumerate(self.hot_counts):
            d = self.d_ff[l] if self.d_ff else int(count)
            mass = self.layer_mass[l] if self.layer_mass else 0.0
            hot = self.hot_mass[l] if self.hot_mass else 0.0
            share = hot / mass if mass > 0 else (1.0 if count == d else 0.0)
            rows.append(
                {
                    "layer": l,
                    "d_ff": d,
                    "hot_count": int(count),
                    "hot_mass_share": float(share),
                    "hot_bytes": int(count) * (self.neuron_bytes[l] if self.neuron_bytes else 0),
                }
            )
        return rows


@dataclass(frozen=True)
class _Blocks:
    """The ILP's variables: every layer's chain of blocks, concatenated."""

    order: tuple[np.ndarray, ...]  # per layer: neuron indices by descending frequency
    csum: tuple[np.ndarray, ...]  # per layer: prefix sums of sorted frequencies (length d_ff + 1)
    layer: np.ndarray  # (n,) layer of each block
    end: np.ndarray  # (n,) hot count if this block is the last fast one of its layer
    mass: np.ndarray  # (n,) activation mass of the block
    cost: np.ndarray  # (n,) int64 bytes of the block
    first: np.ndarray  # (L + 1,) offsets: blocks of layer l are first[l]:first[l + 1]


def _build_blocks(p: PlacementProblem) -> _Blocks:
    orders, csums, layers, ends, masses, costs = [], [], [], [], [], []
    for l, f in enumerate(p.freqs):
        d = f.size
        order = np.argsort(-f, kind="stable")
        csum = np.concatenate(([0.0], np.cumsum(f[order])))
        bounds = np.minimum(np.arange(1, -(-d // p.group_size) + 1) * p.group_size, d)
        end = bounds[bounds >= min(p.min_split_neurons, d)]  # groups below the minimum merge
        start = np.concatenate(([0], end[:-1]))
        orders.append(order)
        csums.append(csum)
        layers.append(np.full(end.size, l))
        ends.append(end)
        masses.append(csum[end] - csum[start])
        costs.append((end - start).astype(np.int64) * p.neuron_bytes[l])
    sizes = [e.size for e in ends]
    return _Blocks(
        order=tuple(orders),
        csum=tuple(csums),
        layer=np.concatenate(layers),
        end=np.concatenate(ends),
        mass=np.concatenate(masses),
        cost=np.concatenate(costs),
        first=np.concatenate(([0], np.cumsum(sizes))),
    )


def _check_dense(p: PlacementProblem) -> None:
    if p.dense_bytes <= p.budget_bytes:
        return
    charged = 0
    for name, b in p.dense_parts:  # name the first part that no longer fits
        if charged + b > p.budget_bytes:
            break
        charged += b
    parts = ", ".join(f"{n}={b}" for n, b in p.dense_parts)
    raise SparseInferError(
        f"fast-tier budget too small: expected budget_bytes >= the dense parts' "
        f"{p.dense_bytes} bytes, got {p.budget_bytes} bytes; charged in order ({parts}), "
        f"'{name}' is the first that does not fit"
    )


def _greedy(blocks: _Blocks, capacity: int) -> np.ndarray:
    """A feasible placement: blocks by mass per byte, each taken if it fits and its
    predecessor was taken. Densities are made non-increasing along each layer's chain first, so
    float noise among tied neurons can never order a block before its predecessor."""
    density = blocks.mass / blocks.cost
    for l in range(blocks.first.size - 1):
        a, b = blocks.first[l], blocks.first[l + 1]
        density[a:b] = np.minimum.accumulate(density[a:b])
    take = np.zeros(blocks.mass.size, dtype=bool)
    left = capacity
    for j in np.lexsort((np.arange(density.size), -density)):  # ties: chain order
        if blocks.cost[j] <= left and (j == blocks.first[blocks.layer[j]] or take[j - 1]):
            take[j] = True
            left -= int(blocks.cost[j])
    return take


def _prefix_counts(blocks: _Blocks, take: np.ndarray) -> np.ndarray:
    """Blocks per layer: the leading run of taken blocks (a prefix by construction)."""
    n_layers = blocks.first.size - 1
    counts = np.zeros(n_layers, dtype=np.int64)
    for l in range(n_layers):
        t = take[blocks.first[l] : blocks.first[l + 1]]
        counts[l] = t.size if t.all() else int(np.argmin(t))
    return counts


def _repair(blocks: _Blocks, nblocks: np.ndarray, capacity: int) -> np.ndarray:
    """Drop last blocks, least mass per byte first, until the exact byte count fits."""
    nblocks = nblocks.copy()
    used = sum(int(blocks.cost[f : f + k].sum()) for f, k in zip(blocks.first, nblocks))
    while used > capacity:
        cand = [l for l, k in enumerate(nblocks) if k > 0]
        last = [blocks.first[l] + nblocks[l] - 1 for l in cand]
        j = min(last, key=lambda j: blocks.mass[j] / blocks.cost[j])
        nblocks[blocks.layer[j]] -= 1
        used -= int(blocks.cost[j])
    return nblocks


def _fixings(
    blocks: _Blocks, capacity: int, incumbent: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """Bounds (lb, ub) that fix every block whose value is decided, by reduced-cost fixing,
    and z(λ), an upper bound on the optimal mass.

    For any price λ >= 0 (mass per byte) and any x in [0, 1] with cost·x <= capacity,
    mass·x <= z(λ) - Σ_{rc_j > 0} rc_j (1 - x_j) - Σ_{rc_j < 0} |rc_j| x_j, where
    rc_j = mass_j - λ cost_j and z(λ) = λ capacity + Σ max(rc_j, 0) (weak duality of the
    knapsack relaxation; the prefix rows only shrink the feasible set). So a block with
    rc_j > z(λ) - mass·incumbent is fast in every optimum, and one with rc_j below minus that
    is slow in every optimum. λ is the LP's critical mass per byte, where the greedy fill stops.
    Usually this leaves only the blocks near the cut undecided.
    """
    density = blocks.mass / blocks.cost
    order = np.argsort(-density, kind="stable")
    k = int(np.searchsorted(np.cumsum(blocks.cost[order]), capacity, side="right"))
    lam = float(density[order[min(k, order.size - 1)]])
    rc = blocks.mass - lam * blocks.cost
    bound = lam * capacity + float(np.maximum(rc, 0.0).sum())
    slack = bound - float(blocks.mass[incumbent].sum())
    slack += 1e-9 * max(1.0, abs(bound))  # rounding margin: never fix a block that might tie
    lb = (rc > slack).astype(np.float64)
    ub = (rc >= -slack).astype(np.float64)
    for l in range(blocks.first.size - 1):  # fast implies fast before it, slow implies slow after
        a, b = blocks.first[l], blocks.first[l + 1]
        lb[a:b] = np.maximum.accumulate(lb[a:b][::-1])[::-1]
        ub[a:b] = np.minimum.accumulate(ub[a:b])
    if (lb > ub).any():  # only float trouble could cause this; then decide nothing
        logger.warning("reduced-cost fixing was inconsistent; solving the full model")
        return np.zeros(lb.size), np.ones(ub.size), bound
    return lb, ub, bound


def _solve_milp(
    blocks: _Blocks, capacity: int, time_limit: float, mip_rel_gap: float
) -> tuple[np.ndarray, str, float]:
    n = blocks.mass.size
    g = int(np.gcd.reduce(blocks.cost))
    cost = blocks.cost // g
    cap = capacity // g  # exact: every cost is a multiple of g
    incumbent = _greedy(blocks, capacity)
    lb, ub, bound = _fixings(blocks, capacity, incumbent)
    ub = np.minimum(ub, cost <= cap)  # blocks that cannot fit at all
    free = int((lb < ub).sum())
    logger.debug("%d of %d blocks left free by reduced-cost fixing", free, n)
    if free == 0:  # the fixings decide every block: an optimal placement without branching
        return lb > 0.5, "optimal", 0.0
    if time_limit <= 0:
        logger.warning("no time left for HiGHS; using the greedy placement")
        return incumbent, "time_limit", _gap(blocks, incumbent, bound)
    # Prefix rows x_{j+1} - x_j <= 0 for consecutive blocks of one layer.
    j = np.flatnonzero(blocks.layer[1:] == blocks.layer[:-1])
    r = np.arange(j.size)
    ones = np.ones(j.size)
    rows, cols = np.concatenate((r, r)), np.concatenate((j + 1, j))
    prefix = sp.csr_array((np.concatenate((ones, -ones)), (rows, cols)), shape=(j.size, n))
    a = sp.vstack([prefix, sp.csr_array(cost.astype(np.float64)[None, :])], format="csr")
    row_ub = np.concatenate((np.zeros(j.size), [float(cap)]))
    res = milp(
        -blocks.mass,
        integrality=np.ones(n),
        bounds=Bounds(lb, ub),
        constraints=LinearConstraint(a, -np.inf, row_ub),
        options={
            "time_limit": float(time_limit),
            "mip_rel_gap": float(mip_rel_gap),
            "presolve": False,  # HiGHS presolve (its probing) takes 10-20 s here and finds nothing
            "disp": False,
        },
    )
    logger.debug("HiGHS: status %d, %s", res.status, res.message)
    take = incumbent if res.x is None else res.x > 0.5
    if res.x is None:
        logger.warning("HiGHS found no solution (%s); using the greedy placement", res.message)
    elif blocks.mass[take].sum() < blocks.mass[incumbent].sum():  # a time-limited incumbent
        take = incumbent
    if res.x is None:
        status = "greedy"
    else:
        status = {0: "optimal", 1: "time_limit"}.get(res.status, "feasible")
    if getattr(res, "mip_dual_bound", None) is not None and np.isfinite(res.mip_dual_bound):
        bound = min(bound, -float(res.mip_dual_bound))
    return take, status, _gap(blocks, take, bound)


def _gap(blocks: _Blocks, take: np.ndarray, bound: float) -> float:
    """Relative gap of a placement to an upper bound on the optimal mass."""
    found = float(blocks.mass[take].sum())
    return max(0.0, bound - found) / max(found, 1e-12)


def solve_placement(
    problem: PlacementProblem, time_limit: float = 30.0, *, mip_rel_gap: float = 1e-6
) -> PlacementSolution:
    """Choose each layer's fast-tier neurons. Raises SparseInferError if the dense parts don't fit.

    ``mip_rel_gap`` is HiGHS's stopping gap: "optimal" means within this fraction of the best
    possible mass (HiGHS also stops at an absolute gap of 1e-6). On ``time_limit`` the best
    feasible placement found so far is returned with status "time_limit".
    """
    if not time_limit > 0:
        raise SparseInferError(f"time_limit: expected seconds > 0, got {time_limit!r}")
    if not 0 <= mip_rel_gap < 1:
        raise SparseInferError(f"mip_rel_gap: expected a fraction in [0, 1), got {mip_rel_gap!r}")
    p = problem
    t0 = time.perf_counter()
    _check_dense(p)
    capacity = p.budget_bytes - p.dense_bytes
    blocks = _build_blocks(p)

    gap = 0.0
    if capacity >= p.neuron_total_bytes:  # everything fits
        nblocks, status = np.diff(blocks.first), "optimal"
    elif capacity < int(blocks.cost[blocks.first[:-1]].min()):  # no layer's first block fits
        nblocks, status = np.zeros(len(p.freqs), dtype=np.int64), "optimal"
    else:
        remaining = time_limit - (time.perf_counter() - t0)
        take, status, gap = _solve_milp(blocks, capacity, remaining, mip_rel_gap)
        nblocks = _repair(blocks, _prefix_counts(blocks, take), capacity)

    hot, counts, hot_mass = [], [], []
    for l in range(len(p.freqs)):
        k = int(blocks.end[blocks.first[l] + nblocks[l] - 1]) if nblocks[l] > 0 else 0
        idx = blocks.order[l][:k].astype(np.int64)
        idx.setflags(write=False)
        hot.append(idx)
        counts.append(k)
        hot_mass.append(float(blocks.csum[l][k]))
    hot_bytes = sum(k * b for k, b in zip(counts, p.neuron_bytes))
    fast_bytes = p.dense_bytes + hot_bytes
    if fast_bytes > p.budget_bytes:  # unreachable: _repair checks exactly
        raise RuntimeError(f"placement uses {fast_bytes} bytes, over the budget {p.budget_bytes}")
    seconds = time.perf_counter() - t0
    sol = PlacementSolution(
        hot=tuple(hot),
        hot_counts=tuple(counts),
        fast_bytes=fast_bytes,
        dense_bytes=p.dense_bytes,
        objective=float(sum(hot_mass)),
        total_mass=float(sum(c[-1] for c in blocks.csum)),
        status=status,
        solve_seconds=seconds,
        d_ff=p.d_ff,
        neuron_bytes=p.neuron_bytes,
        hot_mass=tuple(hot_mass),
        layer_mass=tuple(float(c[-1]) for c in blocks.csum),
        budget_bytes=p.budget_bytes,
        dense_parts=p.dense_parts,
        mip_gap=gap,
    )
    logger.log(
        logging.INFO if status == "optimal" else logging.WARNING,
        "placement: %s in %.2f s, %d layers, %d/%d neurons fast, %.1f%% of activation mass, "
        "%d of %d budget bytes (dense %d)",
        status,
        seconds,
        len(counts),
        sum(counts),
        sum(p.d_ff),
        100.0 * sol.objective / sol.total_mass if sol.total_mass > 0 else 0.0,
        fast_bytes,
        p.budget_bytes,
        p.dense_bytes,
    )
    return sol


# --- the placement file ---------------------------------------------------------------------


def save_placement(path: str | os.PathLike, solution: PlacementSolution) -> None:
    """Write a placement as a small .npz (no pickles). Replaces the file atomically."""
    s = solution
    n = len(s.hot)
    d_ff = s.d_ff or tuple(int(c) for c in s.hot_counts)
    arrays = {
        "format": np.array(PLACEMENT_FORMAT),
        "version": np.array(PLACEMENT_VERSION),
        "hot_indices": np.concatenate([np.zeros(0, np.int64), *(np.asarray(h) for h in s.hot)]),
        "hot_offsets": np.cumsum([0] + [len(h) for h in s.hot], dtype=np.int64),
        "d_ff": np.array(d_ff, dtype=np.int64),
        "neuron_bytes": np.array(s.neuron_bytes or (0,) * n, dtype=np.int64),
        "hot_mass": np.array(s.hot_mass or (0.0,) * n, dtype=np.float64),
        "layer_mass": np.array(s.layer_mass or (0.0,) * n, dtype=np.float64),
        "dense_names": np.array([name for name, _ in s.dense_parts], dtype=np.str_),
        "dense_sizes": np.array([b for _, b in s.dense_parts], dtype=np.int64),
        "ints": np.array([s.fast_bytes, s.dense_bytes, s.budget_bytes], dtype=np.int64),
        "floats": np.array([s.objective, s.total_mass, s.solve_seconds, s.mip_gap], np.float64),
        "status": np.array(s.status),
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, path)
    logger.info("wrote placement for %d layers to %s", n, path)


def load_placement(path: str | os.PathLike) -> PlacementSolution:
    """Read a file written by :func:`save_placement`."""
    path = Path(path)
    a = read_npz(path, "a placement .npz written by save_placement")
    fmt = str(a.get("format", ""))
    if fmt != PLACEMENT_FORMAT:
        raise SparseInferError(
            f"{path}: expected format {PLACEMENT_FORMAT!r}, found {fmt or 'none'!r}"
        )
    version = int(a.get("version", -1))
    if version != PLACEMENT_VERSION:
        raise SparseInferError(
            f"{path}: expected placement version {PLACEMENT_VERSION}, found {version}"
        )
    try:
        off, idx = a["hot_offsets"], a["hot_indices"]
        d_ff = tuple(int(x) for x in a["d_ff"])
        hot = tuple(idx[off[l] : off[l + 1]].astype(np.int64) for l in range(len(off) - 1))
        fast_bytes, dense_bytes, budget_bytes = (int(x) for x in a["ints"])
        objective, total_mass, seconds, gap = (float(x) for x in a["floats"])
        names, sizes = a["dense_names"], a["dense_sizes"]
        nb, hm, lm = a["neuron_bytes"], a["hot_mass"], a["layer_mass"]
        status = str(a["status"])
    except (KeyError, ValueError, IndexError) as e:
        raise SparseInferError(f"{path}: placement file is incomplete or corrupt: {e!r}") from e
    if len(hot) != len(d_ff) or off.size == 0 or off[-1] != idx.size or any(
        h.size > d or (h.size and (h.min() < 0 or h.max() >= d)) for h, d in zip(hot, d_ff)
    ):
        raise SparseInferError(
            f"{path}: expected per-layer hot indices within [0, d_ff) for {len(d_ff)} layers, "
            f"found {len(hot)} layers / indices out of range"
        )
    for h in hot:
        h.setflags(write=False)
    return PlacementSolution(
        hot=hot,
        hot_counts=tuple(int(h.size) for h in hot),
        fast_bytes=fast_bytes,
        dense_bytes=dense_bytes,
        objective=objective,
        total_mass=total_mass,
        status=status,
        solve_seconds=seconds,
        d_ff=d_ff,
        neuron_bytes=tuple(int(x) for x in nb),
        hot_mass=tuple(float(x) for x in hm),
        layer_mass=tuple(float(x) for x in lm),
        budget_bytes=budget_bytes,
        dense_parts=tuple((str(n), int(b)) for n, b in zip(names, sizes)),
        mip_gap=gap,
    )
