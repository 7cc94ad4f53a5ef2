"""The co-activation order of bundles (sparseinfer.disk.order) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from sparseinfer.disk.order import coactivation_order, positions_of, reads_per_token


def _runs_brute(masks: np.ndarray, positions, skip: int, gap: int = 0) -> float:
    """Reads per token counted one token at a time: runs of file rows, gaps of up to ``gap``."""
    total = 0
    for row in masks:
        active = [n for n in np.flatnonzero(row) if n >= skip]
        rows = sorted(positions[n] if positions is not None else n for n in active)
        total += sum(1 for k, r in enumerate(rows) if k == 0 or r - rows[k - 1] > gap + 1)
    return total / len(masks)


def _clustered(T=300, F=96, groups=12, seed=0) -> np.ndarray:
    """Masks where neurons fire in groups (a token picks a few groups), the groups' members
    scattered over the neuron ids."""
    rng = np.random.default_rng(seed)
    group = rng.permutation(np.arange(F) % groups)
    picks = rng.random((T, groups)) < 0.15
    return picks[:, group] & (rng.random((T, F)) < 0.95)


@pytest.mark.parametrize("skip", [0, 10, 50])
@pytest.mark.parametrize("gap", [0, 1, 3])
def test_reads_per_token_counts_runs(skip, gap):
    m = _clustered()
    rng = np.random.default_rng(1)
    pos = rng.permutation(m.shape[1])
    assert reads_per_token(m, None, skip, gap) == pytest.approx(_runs_brute(m, None, skip, gap))
    assert reads_per_token(m, pos, skip, gap) == pytest.approx(_runs_brute(m, pos, skip, gap))


def test_order_is_a_permutation_that_groups_co_activated_neurons():
    m = _clustered()
    order = coactivation_order(m)
    assert sorted(order.tolist()) == list(range(m.shape[1]))
    pos = positions_of(order)
    assert np.array_equal(order[pos], np.arange(m.shape[1]))
    plain = reads_per_token(m, None)
    ordered = reads_per_token(m, pos)
    # each picked group becomes about one read instead of one per member
    assert ordered < 0.4 * plain, (plain, ordered)
    # independent neurons: no order can merge much, and the greedy path must not make it worse
    rng = np.random.default_rng(3)
    iid = rng.random((300, 96)) < 0.1
    assert reads_per_token(iid, positions_of(coactivation_order(iid))) <= \
        1.05 * reads_per_token(iid, None)


def test_order_uses_at_most_max_tokens():
    m = _clustered(T=500)
    # evenly spaced tokens when there are more
    assert np.array_equal(coactivation_order(m, max_tokens=100),
                          coactivation_order(m[np.linspace(0, 499, 100).round().astype(int)]))
    with pytest.raises(ValueError, match="tokens, neurons"):
        coactivation_order(m[0])
