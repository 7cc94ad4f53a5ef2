"""Placement ILP: optimal against brute force and a DP, never over budget, clear errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import OptimizeResult

from sparseinfer.errors import SparseInferError
from sparseinfer.offline import solve as solve_mod
from sparseinfer.offline.solve import (
    PlacementProblem,
    PlacementSolution,
    load_placement,
    save_placement,
    solve_placement,
)

# --- independent references ------------------------------------------------------------------


def layer_options(f: np.ndarray, group_size: int, min_split: int) -> list[tuple[int, float]]:
    """(count, mass) of every allowed fast set: 0, d_ff, or a group boundary >= the minimum."""
    d = f.size
    top = np.concatenate(([0.0], np.cumsum(np.sort(f)[::-1])))
    counts = {min(g * group_size, d) for g in range(-(-d // group_size) + 1)}
    return [(c, float(top[c])) for c in sorted(counts) if c in (0, d) or c >= min(min_split, d)]


def brute_force(p: PlacementProblem) -> float:
    """Best mass over every combination of allowed per-layer counts."""
    capacity = p.budget_bytes - p.dense_bytes
    opts = [layer_options(f, p.group_size, p.min_split_neurons) for f in p.freqs]
    best = 0.0
    for combo in itertools.product(*opts):
        if sum(c * b for (c, _), b in zip(combo, p.neuron_bytes)) <= capacity:
            best = max(best, sum(m for _, m in combo))
    return best


def knapsack_dp(p: PlacementProblem) -> float:
    """Multiple-choice knapsack over exact byte counts (small integer costs only)."""
    capacity = p.budget_bytes - p.dense_bytes
    best = np.zeros(capacity + 1)  # best[c]: max mass within c bytes
    for f, b in zip(p.freqs, p.neuron_bytes):
        new = np.full(capacity + 1, -np.inf)
        for count, mass in layer_options(f, p.group_size, p.min_split_neurons):
            cost = count * b
            if cost <= capacity:
                new[cost:] = np.maximum(new[cost:], best[: capacity + 1 - cost] + mass)
        best = new
    return float(best[capacity])


def random_problem(
    rng: np.random.Generator, n_layers: int, d_range: tuple[int, int], **kw
) -> PlacementProblem:
    freqs = []
    for _ in range(n_layers):
        d = int(rng.integers(*d_range))
        kind = rng.integers(3)
        if kind == 0:
            f = rng.uniform(0, 1, d)
        elif kind == 1:  # power law
            f = rng.permutation(np.arange(1, d + 1) ** -rng.uniform(0.3, 1.5))
        else:  # ties and zeros
            f = np.round(rng.uniform(0, 1, d) ** 3, 1)
        freqs.append(f)
    nb = tuple(int(x) for x in rng.integers(1, kw.pop("max_neuron_bytes", 8) + 1, n_layers))
    dense = tuple((n, int(rng.integers(0, 50))) for n in ("embeddings", "kv_cache", "attention"))
    dense_total = sum(b for _, b in dense)
    neurons = sum(f.size * b for f, b in zip(freqs, nb))
    budget = dense_total + int(rng.integers(0, int(neurons * 1.1) + 2))
    return PlacementProblem(
        freqs=tuple(freqs), neuron_bytes=nb, budget_bytes=budget, dense_parts=dense, **kw
    )


def check_solution(p: PlacementProblem, s: PlacementSolution) -> None:
    """Everything a solution promises, checked from the problem alone."""
    assert s.fast_bytes <= p.budget_bytes
    assert s.dense_bytes == p.dense_bytes
    assert s.fast_bytes == p.dense_bytes + sum(len(h) * b for h, b in zip(s.hot, p.neuron_bytes))
    assert s.hot_counts == tuple(len(h) for h in s.hot)
    mass = 0.0
    for f, h in zip(p.freqs, s.hot):
        d, k = f.size, len(h)
        assert h.dtype == np.int64
        assert len(set(h.tolist())) == k and (k == 0 or (h.min() >= 0 and h.max() < d))
        # min split: no layer split with fewer than min(min_split, d_ff) fast neurons
        assert k == 0 or k == d or k >= min(p.min_split_neurons, d)
        # group granularity: a whole number of groups unless the layer is entirely fast
        assert k == d or k % p.group_size == 0
        # the hottest neurons, hottest first
        assert np.all(np.diff(f[h]) <= 0)
        cold = np.setdiff1d(np.arange(d), h)
        if k and cold.size:
            assert f[h].min() >= f[cold].max()
        mass += float(f[h].sum())
    assert s.objective == pytest.approx(mass, rel=1e-9, abs=1e-9)
    assert s.total_mass == pytest.approx(sum(float(f.sum()) for f in p.freqs), rel=1e-9, abs=1e-9)


# --- optimality ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [s if s < 10 else pytest.param(s, marks=pytest.mark.slow)
                                  for s in range(60)])
def test_optimum_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    gs = int(rng.integers(2, 7))
    p = random_problem(
        rng,
        n_layers=int(rng.integers(2, 4)),
        d_range=(1, 6 * gs),  # partial last groups, and layers smaller than min_split
        group_size=gs,
        min_split_neurons=int(rng.integers(0, 4 * gs)),
    )
    s = solve_placement(p, mip_rel_gap=0.0)
    check_solution(p, s)
    assert s.status == "optimal"
    assert s.objective == pytest.approx(brute_force(p), rel=1e-9, abs=1e-7)


@pytest.mark.parametrize("seed", range(24))
def test_optimum_equals_knapsack_dp(seed):
    """More layers and neurons than brute force can enumerate (reduced-cost fixing at work)."""
    rng = np.random.default_rng(1000 + seed)
    gs = int(rng.integers(4, 17))
    p = random_problem(
        rng,
        n_layers=int(rng.integers(5, 10)),
        d_range=(20, 300),
        group_size=gs,
        min_split_neurons=int(rng.integers(0, 80)),
        max_neuron_bytes=5,
    )
    s = solve_placement(p, mip_rel_gap=0.0)
    check_solution(p, s)
    assert s.status == "optimal"
    assert s.objective == pytest.approx(knapsack_dp(p), rel=1e-9, abs=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_optimum_equals_knapsack_dp_many_layers(seed):
    """Dozens of layers with near-equal mass per byte: many blocks stay free for HiGHS."""
    rng = np.random.default_rng(2000 + seed)
    p = random_problem(
        rng,
        n_layers=40,
        d_range=(200, 1200),
        group_size=32,
        min_split_neurons=int(rng.integers(0, 200)),
        max_neuron_bytes=3,
    )
    s = solve_placement(p, mip_rel_gap=0.0)
    check_solution(p, s)
    assert s.status == "optimal"
    assert s.objective == pytest.approx(knapsack_dp(p), rel=1e-9, abs=1e-7)


@pytest.mark.parametrize("seed", [s if s < 10 else pytest.param(s, marks=pytest.mark.slow)
                                  for s in range(100)])
def test_budget_never_exceeded(seed):
    rng = np.random.default_rng(5000 + seed)
    p = random_problem(
        rng,
        n_layers=int(rng.integers(1, 8)),
        d_range=(1, 400),
        group_size=int(rng.integers(1, 70)),
        min_split_neurons=int(rng.integers(0, 300)),
        max_neuron_bytes=10_000,
    )
    check_solution(p, solve_placement(p))


# --- budgets at the edges --------------------------------------------------------------------


def small_problem(budget_bytes: int, **kw) -> PlacementProblem:
    rng = np.random.default_rng(7)
    return PlacementProblem(
        freqs=(rng.uniform(0, 1, 300), rng.uniform(0, 1, 200), rng.uniform(0, 1, 130)),
        neuron_bytes=(12, 12, 20),
        budget_bytes=budget_bytes,
        dense_parts=(("embeddings", 1000), ("kv_cache", 500), ("attention", 3000)),
        **kw,
    )


def test_budget_equal_to_dense_parts_gives_no_hot_neurons():
    p = small_problem(4500)
    s = solve_placement(p)
    check_solution(p, s)
    assert s.hot_counts == (0, 0, 0)
    assert s.fast_bytes == s.dense_bytes == 4500
    assert s.objective == 0.0 and s.status == "optimal"


@pytest.mark.parametrize("extra", [0, 1, 10**9])
def test_budget_holding_everything_gives_all_neurons(extra):
    p = small_problem(4500 + 300 * 12 + 200 * 12 + 130 * 20 + extra)
    s = solve_placement(p)
    check_solution(p, s)
    assert s.hot_counts == (300, 200, 130)
    assert s.objective == pytest.approx(s.total_mass)
    assert [r["hot_mass_share"] for r in s.summary_rows()] == pytest.approx([1.0, 1.0, 1.0])


def test_budget_below_dense_parts_names_both_byte_counts():
    with pytest.raises(SparseInferError) as e:
        solve_placement(small_problem(4499))
    msg = str(e.value)
    assert "4500" in msg and "4499" in msg and "attention" in msg


def test_min_split_respected_and_clipped_to_d_ff():
    # Layer 1 has 200 < min_split neurons: it is either empty or entirely fast.
    p = small_problem(4500 + 2500, group_size=16, min_split_neurons=250)
    s = solve_placement(p, mip_rel_gap=0.0)
    check_solution(p, s)
    assert s.objective == pytest.approx(brute_force(p))
    for k, d in zip(s.hot_counts, (300, 200, 130)):
        assert k in (0, d) or k >= min(250, d)


def test_min_split_zero_and_group_size_one_take_hottest_neurons():
    p = small_problem(4500 + 777, group_size=1, min_split_neurons=0)
    s = solve_placement(p, mip_rel_gap=0.0)
    check_solution(p, s)
    assert s.fast_bytes >= 4500 + 777 - 20  # a greedy fill leaves less than one neuron spare


# --- robustness ------------------------------------------------------------------------------


def test_greedy_fallback_when_highs_returns_nothing(monkeypatch):
    def no_solution(*args, **kwargs):
        return OptimizeResult(status=1, x=None, mip_gap=None, message="time limit reached")

    monkeypatch.setattr(solve_mod, "milp", no_solution)
    p = small_problem(4500 + 3000)
    s = solve_placement(p)
    check_solution(p, s)
    assert s.status == "greedy" and s.objective > 0


def test_repair_drops_blocks_until_the_budget_fits():
    p = small_problem(4500 + 3000, group_size=10, min_split_neurons=0)
    blocks = solve_mod._build_blocks(p)
    over = solve_mod._repair(blocks, np.diff(blocks.first), 3000)  # start from all blocks
    used = sum(int(blocks.cost[f : f + k].sum()) for f, k in zip(blocks.first, over))
    assert used <= 3000


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(freqs=()), "at least one layer"),
        (dict(freqs=(np.array([]),)), "non-empty"),
        (dict(freqs=(np.ones((2, 2)),)), "1-D"),
        (dict(freqs=(np.array([0.5, 1.5]),)), "[0, 1]"),
        (dict(freqs=(np.array([0.5, -0.1]),)), "[0, 1]"),
        (dict(freqs=(np.array([0.5, np.nan]),)), "[0, 1]"),
        (dict(neuron_bytes=(4, 4)), "one entry per layer"),
        (dict(neuron_bytes=(-4,)), "neuron_bytes[0]"),
        (dict(neuron_bytes=(0,)), "neuron_bytes[0]"),
        (dict(neuron_bytes=(2.5,)), "neuron_bytes[0]"),
        (dict(budget_bytes=-1), "budget_bytes"),
        (dict(dense_parts=(("kv_cache", -3),)), "kv_cache"),
        (dict(dense_parts=((1, 2),)), "(name, bytes)"),
        (dict(group_size=0), "group_size"),
        (dict(min_split_neurons=-1), "min_split_neurons"),
    ],
)
def test_invalid_problems_raise_clear_errors(kw, expected):
    args = dict(freqs=(np.array([0.5, 0.25]),), neuron_bytes=(4,), budget_bytes=100) | kw
    with pytest.raises(SparseInferError, match="expected") as e:
        PlacementProblem(**args)
    assert expected in str(e.value)


def test_problem_copies_and_freezes_inputs():
    f = np.array([0.1, 0.9])
    p = PlacementProblem(freqs=[f], neuron_bytes=[np.int64(4)], budget_bytes=np.int64(100))
    f[0] = 0.5  # the caller's array is not the problem's
    assert p.freqs[0][0] == 0.1 and not p.freqs[0].flags.writeable
    assert p.neuron_bytes == (4,) and type(p.budget_bytes) is int


# --- file and summary ------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    p = small_problem(4500 + 3000, group_size=8, min_split_neurons=32)
    s = solve_placement(p)
    path = tmp_path / "placement.npz"
    save_placement(path, s)
    r = load_placement(path)
    assert all(np.array_equal(a, b) for a, b in zip(r.hot, s.hot))
    for field in ("hot_counts", "fast_bytes", "dense_bytes", "objective", "total_mass", "status",
                  "d_ff", "neuron_bytes", "hot_mass", "layer_mass", "budget_bytes", "dense_parts"):
        assert getattr(r, field) == getattr(s, field), field
    assert r.summary_rows() == s.summary_rows()


def test_load_rejects_other_files(tmp_path):
    with pytest.raises(SparseInferError, match="no such file"):
        load_placement(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(SparseInferError, match="bad.npz"):
        load_placement(bad)
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(SparseInferError, match="expected format"):
        load_placement(other)


def test_summary_rows():
    p = small_problem(4500 + 3000, group_size=8, min_split_neurons=32)
    s = solve_placement(p)
    rows = s.summary_rows()
    assert [r["layer"] for r in rows] == [0, 1, 2]
    assert [r["d_ff"] for r in rows] == [300, 200, 130]
    assert [r["hot_count"] for r in rows] == list(s.hot_counts)
    for r, f, h in zip(rows, p.freqs, s.hot):
        assert r["hot_mass_share"] == pytest.approx(f[h].sum() / f.sum())


def test_no_time_left_returns_the_greedy_placement():
    rng = np.random.default_rng(3)
    p = PlacementProblem(
        freqs=tuple(np.round(rng.uniform(0, 1, 2000), 1) for _ in range(6)),
        neuron_bytes=(3, 5, 7, 3, 5, 7),
        budget_bytes=25_001,
        group_size=16,
        min_split_neurons=100,
    )
    s = solve_placement(p, time_limit=1e-9)
    check_solution(p, s)
    assert s.status == "time_limit" and 0 <= s.mip_gap < 1e-2
    assert s.objective <= solve_placement(p, mip_rel_gap=0.0).objective
