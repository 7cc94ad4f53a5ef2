"""sparseinfer.cpu.topk (sampling's top-k in C) against torch.topk and a brute-force stable sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu


def brute(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest, largest first, equal values lower index first (NaN last)."""
    key = np.where(np.isnan(x), np.inf, -x.astype(np.float64))
    return np.argsort(key, kind="stable")[:k]


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 33, 1000, 4099, 49152])
@pytest.mark.parametrize("k", [1, 2, 40, 4096])
def test_equals_torch_topk(n, k):
    k = min(k, n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + k))
    vals, ids = cpu.topk(x, k)
    want_v, want_i = torch.topk(x, k)
    assert torch.equal(vals, want_v) and torch.equal(ids, want_i)


@pytest.mark.parametrize("k", [1, 5, 40, 300])
def test_ties_infinities_and_nan_follow_the_stated_order(k):
    rng = np.random.default_rng(k)
    x = rng.integers(-3, 4, size=1000).astype(np.float32)  # many equal values
    x[rng.integers(0, 1000, 50)] = -np.inf  # masked tokens (grammars, logit_bias)
    x[rng.integers(0, 1000, 3)] = np.inf
    vals, ids = cpu.topk(torch.from_numpy(x), k)
    assert ids.tolist() == brute(x, k).tolist()
    assert np.array_equal(vals.numpy(), x[ids.numpy()])
    y = np.full(10, -np.inf, dtype=np.float32)
    y[[2, 7]] = [1.0, np.nan]
    vals, ids = cpu.topk(torch.from_numpy(y), 4)
    assert ids.tolist() == [2, 0, 1, 3]  # NaN only when fewer than k other values
    _, ids = cpu.topk(torch.from_numpy(y), 10)
    assert ids.tolist() == [2, 0, 1, 3, 4, 5, 6, 8, 9, 7]


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 3"):
        cpu.topk(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="expected contiguous float32"):
        cpu.topk(torch.zeros(3, dtype=torch.float64), 1)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1000, 40),
                                 pytest.param(49152, 40, marks=pytest.mark.slow),
                                 pytest.param(49152, 1000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("params", [(1.0, 0.0, 1.0), (0.95, 0.05, 0.8), (0.5, 0.0, 1.5),
                                    (1.0, 0.3, 0.2), (0.9, 0.1, 1e-3)])
def test_sample_topk_picks_what_the_numpy_reference_picks(n, k, params):
    """cpu.sample_topk against generate.sample_ref (torch.topk, then numpy in float64) for the
    same uniform: logits with a peaked head as a language model's, ties (rounded logits) and
    uniforms spread over [0, 1), the ends included."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.generate import sample_ref

    top_p, min_p, temperature = params
    p = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p)
    g = torch.Generator().manual_seed(n + k)
    for trial in range(6):
        x = torch.randn(n, generator=g) * (1 + 3 * trial)
        if trial % 2:
            x = torch.round(x * 4) / 4  # ties
        if trial == 4:  # a grammar's mask: a few allowed tokens, the rest -inf
            x[torch.randperm(n, generator=g)[: max(n - 3, 0)]] = float("-inf")
        for u in [0.0, 0.999999, *torch.rand(20, generator=g, dtype=torch.float64).tolist()]:
            assert cpu.sample_topk(x, k, top_p, min_p, temperature, u) == sample_ref(x, p, u)


def test_sample_topk_bad_arguments_say_what_was_expected():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 10, got 11"):
        cpu.sample_topk(x, 11, 1.0, 0.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="temperature > 0 and 0 <= u < 1"):
        cpu.sample_topk(x, 3, 1.0, 0.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="temperature > 0 and 0 <= u < 1"):
        cpu.sample_topk(x, 3, 1.0, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu.sample_topk(x.double(), 3, 1.0, 0.0, 1.0, 0.5)
