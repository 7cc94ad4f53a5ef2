"""The predictor's active set in the C library (float16 weights, rank padded to 32) vs the
pure-torch reference ``predict_active_ref`` in float64 on the same float16 values."""

from __future__ import annotations

import pytest
import torch

from sparseinfer import cpu
from sparseinfer.sparse.reference import predict_active_ref


def case(d_model: int, d_ff: int, r: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(r, d_model, generator=g) / d_model**0.5).half()
    fc2 = (torch.randn(d_ff, r, generator=g) / r**0.5).half()
    x = torch.randn(d_model, generator=g)
    return fc1, fc2, x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d_model,d_ff,r", [(64, 100, 16), (256, 1000, 48), (512, 777, 64),
                                            (4096, 11008, 32)])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 1.0])  # the share of neurons selected
def test_matches_reference(isa, threads, d_model, d_ff, r, share):
    fc1, fc2, x = case(d_model, d_ff, r, seed=d_model + r)
    logits = fc2.double() @ torch.relu(fc1.double() @ x.double())
    g = torch.Generator().manual_seed(1)
    # per-neuron thresholds: a quantile of the logits plus per-neuron jitter (a folded bias)
    q = {0.0: float("inf"), 1.0: -float("inf")}.get(share)
    base = logits.quantile(1 - share).item() if q is None else q
    thr = (base + 0.01 * torch.randn(d_ff, generator=g)).float()
    cpu.set_threads(threads)
    try:
        p = cpu.F16Predictor(fc1, fc2, thr)
        idx = torch.empty(d_ff, dtype=torch.int32)
        k = cpu.predict_f16(p, x, idx)
    finally:
        cpu.set_threads(1)
    ref_idx = torch.empty(d_ff, dtype=torch.int32)
    k_ref = predict_active_ref(x, fc1.float(), fc2.float(), 0.0, ref_idx,
                               neuron_thresholds=thr)
    got, want = set(idx[:k].tolist()), set(ref_idx[:k_ref].tolist())
    # float32 sums in another order may flip neurons within rounding of their threshold only
    margin = (logits - thr.double()).abs()
    tol = 1e-5 * (fc2.double().abs() @ torch.relu(fc1.double() @ x.double()).abs()) + 1e-6
    assert all(margin[i] <= tol[i] for i in got ^ want)
    assert idx[:k].tolist() == sorted(got)  # ascending
    if share == 0.0:
        assert k == 0
    if share == 1.0:
        assert k == d_ff


def test_padding_keeps_logits():
    fc1, fc2, x = case(64, 50, 20, seed=3)
    p = cpu.F16Predictor(fc1, fc2, torch.zeros(50))
    assert p.r == 32 and p.fc1[20:].abs().sum() == 0 and p.fc2[:, 20:].abs().sum() == 0
    idx = torch.empty(50, dtype=torch.int32)
    cpu.predict_f16(p, x, idx)
    want = fc2.float() @ torch.relu(fc1.float() @ x)
    torch.testing.assert_close(p.logits, want, rtol=1e-4, atol=1e-4)


def test_bad_arguments_say_what_was_expected():
    fc1, fc2, x = case(64, 50, 32, seed=4)
    with pytest.raises(ValueError, match="d_model"):
        cpu.F16Predictor(fc1[:, :40], fc2, torch.zeros(50))
    p = cpu.F16Predictor(fc1, fc2, torch.zeros(50))
    with pytest.raises(ValueError, match="float32"):
        cpu.predict_f16(p, x.double(), torch.empty(50, dtype=torch.int32))
    with pytest.raises(ValueError, match="length >= 50"):
        cpu.predict_f16(p, x, torch.empty(10, dtype=torch.int32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d_model,d_ff,r", [(64, 100, 16), (576, 1536, 16), (512, 777, 64)])
@pytest.mark.parametrize("T", [1, 3, 8, 20])
def test_mask_rows_equal_each_token_alone(isa, threads, d_model, d_ff, r, T):
    """Several tokens at once (a batched step's masks): each row exactly the set the lone call
    selects for that token (its logits a GEMM row, bit for bit its GEMV), thresholds at the
    median logit so that many neurons sit near them."""
    fc1, fc2, _ = case(d_model, d_ff, r, seed=d_model + T)
    x = torch.randn(T, d_model, generator=torch.Generator().manual_seed(T))
    logits = (fc2.double() @ torch.relu(fc1.double() @ x.double().t())).t()
    thr = logits.median(dim=0).values.float()
    cpu.set_threads(threads)
    try:
        p = cpu.F16Predictor(fc1, fc2, thr)
        mask = cpu.predict_f16_mask(p, x)
        idx = torch.empty(d_ff, dtype=torch.int32)
        alone = []
        for t in range(T):
            k = cpu.predict_f16(p, x[t].contiguous(), idx)
            alone.append(idx[:k].tolist())
    finally:
        cpu.set_threads(1)
    assert mask.dtype == torch.bool and mask.shape == (T, d_ff)
    for t in range(T):
        assert torch.nonzero(mask[t]).reshape(-1).tolist() == alone[t], t
    assert 0 < mask.sum() < T * d_ff


def test_mask_bad_input_says_what_was_expected():
    fc1, fc2, x = case(64, 50, 32, seed=4)
    p = cpu.F16Predictor(fc1, fc2, torch.zeros(50))
    with pytest.raises(ValueError, match=r"float32 \[T, 64\]"):
        cpu.predict_f16_mask(p, x)  # one token without its T axis
    assert cpu.predict_f16_mask(p, x.view(1, 64)).shape == (1, 50)
