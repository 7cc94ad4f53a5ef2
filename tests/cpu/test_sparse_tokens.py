"""Several tokens through one sparse C call (a continuous-batching step over the union of the
rows' active sets): each token's numbers depend on its own x and neurons only, whatever the other
tokens. Where a call's tokens go one by one (q4 rows, ReLU-family gates first, instruction sets
below AVX-512) a token gets the bits of a call for it alone: it skips the down rows of its own
neurons whose h is 0 and adds the rest in its own groups of 4. The batched int8 pass (AVX-512,
int8 rows, a gate that is not ReLU: ``i8_batch`` in kernels.c) sums in another order than a
one-token call: within rounding of it. Both bundle kinds, gated and ReLU-family FFNs, 1 and 2
threads, every instruction set this CPU has."""

from __future__ import annotations

import pytest
import torch

from sparseinfer.sparse import kernels
from sparseinfer.sparse.reference import sparse_ffn_batch_ref

from .ffn_cases import batched_int8, random_ffn, ref_x

ROWS = [("q4", 0), ("int8", 32), ("int8", 0)]


def one_by_one(ffn, x, idx):
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        kernels.sparse_ffn(x[t], ffn, idx, out[t])
    return out


def assert_within_rounding(got, want):
    """got and want the same sums in another order: apart by float32 rounding of the terms."""
    tol = 2e-6 * want.abs().amax(dim=-1, keepdim=True) + 1e-30
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() / tol).max()


@pytest.mark.parametrize("kind", ["swiglu", "reglu", "relu"])
@pytest.mark.parametrize("dtype,block", ROWS, ids=["q4", "int8-32", "int8-row"])
@pytest.mark.parametrize("T", [2, 5, 8])
def test_tokens_of_a_batch_are_their_own_calls(kind, dtype, block, T, isa, threads):
    d_model, d_ff = 128, 160
    ffn = random_ffn(kind, d_model, d_ff, seed=T, dtype=dtype, block=block)
    idx = torch.sort(torch.randperm(d_ff, generator=torch.Generator().manual_seed(T))[:100])[0]
    idx = idx.to(torch.int32)
    x = torch.randn(T, d_model, generator=torch.Generator().manual_seed(1))
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, d_model), float("nan")))
    if dtype == "int8" and batched_int8(kind, isa):
        assert_within_rounding(got, one_by_one(ffn, x, idx))
    else:
        assert torch.equal(got, one_by_one(ffn, x, idx))
    # token 0 beside other tokens: its bits again (no mask: the neuron ranges do not depend on x)
    x2 = torch.randn(T, d_model, generator=torch.Generator().manual_seed(7))
    x2[0] = x[0]
    again = kernels.sparse_ffn_batch(x2, ffn, idx, torch.full((T, d_model), float("nan")))
    assert torch.equal(again[0], got[0])
    if kind != "swiglu":  # the case the per-token skip is for: h = 0 for some tokens, not all
        g = ffn.rows_fp32(idx.long())
        z = torch.einsum("kd,td->tk", g[:, 0], x)
        if ffn.up_bias is not None:
            z = z + ffn.up_bias[idx.long()]
        fired = z > 0
        assert fired.any(dim=0).sum() > fired.all(dim=0).sum()


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
@pytest.mark.parametrize("dtype,block", ROWS, ids=["q4", "int8-32", "int8-row"])
@pytest.mark.parametrize("T", [40, 90])
def test_more_tokens_than_a_pass_holds(kind, dtype, block, T, threads):
    """More tokens than one pass of the kernels' per-token queues (16) or the batched int8 pass
    (8): 40, split between the threads by neurons (into partial sums); 90, by tokens in ranges of
    whole passes, the last one short. Each row as the reference's (on the x the kernel rounds)."""
    ffn = random_ffn(kind, 64, 90, seed=0, dtype=dtype, block=block)
    idx = torch.arange(0, 90, 2, dtype=torch.int32)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, 64), float("nan")))
    want = sparse_ffn_batch_ref(ref_x(ffn, x), ffn, idx, torch.empty(T, 64))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["swiglu", "reglu"])
@pytest.mark.parametrize("dtype,block", ROWS, ids=["q4", "int8-32", "int8-row"])
@pytest.mark.parametrize("T", [3, 8, 20])
def test_mask_gives_each_token_its_own_set(kind, dtype, block, T, isa, threads):
    """mask[t, i]: token t takes neuron idx[i] only where set (its own set within the union);
    each row as the reference over that token's own neurons (on the x the kernel rounds)."""
    d_model, d_ff = 96, 120
    ffn = random_ffn(kind, d_model, d_ff, seed=T, dtype=dtype, block=block)
    g = torch.Generator().manual_seed(T)
    idx = torch.sort(torch.randperm(d_ff, generator=g)[:90])[0].to(torch.int32)
    mask = torch.rand(T, 90, generator=g) < 0.4
    mask[0] = True  # a token with every neuron of the union, and one with none
    mask[1] = False
    x = torch.randn(T, d_model, generator=g)
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, d_model), float("nan")), mask)
    xr = ref_x(ffn, x)
    for t in range(T):
        want = sparse_ffn_batch_ref(xr[t:t + 1], ffn, idx[mask[t]], torch.empty(1, d_model))[0]
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(d_model))
    full = kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(T, d_model))
    if threads == 1:  # every bit as without a mask (on two threads, up to 8 tokens, the neuron
        assert torch.equal(got[0], full[0])  # ranges are cut by the masks' work: other sums)
    else:
        torch.testing.assert_close(got[0], full[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "reglu", "relu"])
@pytest.mark.parametrize("block", [32, 0])
@pytest.mark.parametrize("T", [2, 8, 20])
@pytest.mark.parametrize("k", [120, 117])  # whole groups of neurons (4, 8), and a short last one
@pytest.mark.parametrize("scale", [1.0, 300.0])  # x large: gates far out, SiLU's exp clamped
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_masked_int8_tokens_do_not_depend_on_the_others(kind, block, T, k, scale, isa, threads):
    """With a mask each token gets the numbers of a call for its own neurons alone — its bits
    where tokens go one by one, within rounding in the batched int8 pass — and, on one thread
    (a call's neuron ranges on several threads are cut by the masks' work), its bits whatever
    the other tokens and their sets: what lets a batched sequence's logits not depend on who
    shares its steps."""
    ffn = random_ffn(kind, 96, 150, seed=T, dtype="int8", block=block)
    g = torch.Generator().manual_seed(T + 1)
    idx = torch.sort(torch.randperm(150, generator=g)[:k])[0].to(torch.int32)
    mask = torch.rand(T, k, generator=g) < 0.6
    x = torch.randn(T, 96, generator=g) * scale
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, 96), float("nan")), mask)
    for t in range(T):
        alone = kernels.sparse_ffn(x[t].clone(), ffn, idx[mask[t]].contiguous(), torch.empty(96))
        if batched_int8(kind, isa):
            assert_within_rounding(got[t], alone)
        else:
            assert torch.equal(got[t], alone), t
    # each token beside others of other x and sets (its own row of the mask kept): its bits
    x2, mask2 = torch.randn(T, 96, generator=g) * scale, torch.rand(T, k, generator=g) < 0.3
    for t in range(T):
        x3, mask3 = x2.clone(), mask2.clone()
        x3[t], mask3[t] = x[t], mask[t]
        again = kernels.sparse_ffn_batch(x3, ffn, idx, torch.empty(T, 96), mask3)
        assert torch.equal(again[t], got[t]), t


def test_mask_errors():
    ffn = random_ffn("swiglu", 64, 10, seed=0, dtype="int8", block=32)
    idx, x = torch.arange(4, dtype=torch.int32), torch.zeros(2, 64)
    with pytest.raises(ValueError, match=r"mask: expected contiguous bool or uint8 \[2, 4\]"):
        kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(2, 64),
                                 torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask: expected contiguous bool or uint8"):
        kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(2, 64), torch.ones(2, 4))
    fp32 = random_ffn("swiglu", 64, 10, seed=0, dtype="fp32")  # numba's kernel: its own check
    with pytest.raises(ValueError, match=r"mask: expected bool or uint8 \[2, 4\]"):
        kernels.sparse_ffn_batch(x, fp32, idx, torch.empty(2, 64), torch.ones(2, 4))
