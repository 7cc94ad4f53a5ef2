"""Sparse FFN over int8 neuron bundles in the C library (``cpu.sparse_ffn_i8``, ``PackedFFN``
dtype "int8" with blocks a multiple of 8) vs the pure-torch reference on the same stored weights,
over every instruction set this CPU has, 1 and 2 threads, one token and several. Where blocks and
rows are multiples of 32 the kernel rounds x to int8 per 32 for the gate/up products (as the Q4
GEMV does): the reference then takes that rounded x (``cpu.reference.quantize_x_ref``)."""

from __future__ import annotations

import pytest
import torch

from sparseinfer import cpu
from sparseinfer.config import FFN_KINDS
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN
from sparseinfer.sparse.reference import sparse_ffn_batch_ref, sparse_ffn_ref

from .ffn_cases import random_ffn, ref_x


def make_ffn(kind: str, d_model: int, d_ff: int, block: int, seed: int) -> PackedFFN:
    return random_ffn(kind, d_model, d_ff, seed, "int8", block)


def active_set(d_ff: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(d_ff, generator=g)[:round(d_ff * density)].to(torch.int32)  # unsorted


def tolerance(ffn: PackedFFN, x: torch.Tensor, idx: torch.Tensor) -> float:
    """Kernel and reference read the same int8 weights and scales in float32 and differ only by
    summation order: a few ulps of the magnitude of the summed terms."""
    rows = ffn.rows_fp32(idx.long())  # [k, n_mats, d]
    z = rows[:, :-1].abs() @ x.abs()  # |gate|/|up| terms
    h = z.prod(dim=1) if FFN_KINDS[ffn.kind].gated else z[:, 0] + 1.0
    mag = float((h @ rows[:, -1].abs()).max()) if idx.numel() else 0.0
    return 64 * torch.finfo(torch.float32).eps * (mag + 1.0)


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "relu", "reglu", "drelu"])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
# (d_model, block): one scale per row (block 0), blocks of 32, 16, 8 and 24 with a short last one
@pytest.mark.parametrize("d_model,block", [(64, 0), (96, 32), (64, 16), (40, 8), (56, 24)])
def test_sparse_i8_matches_reference(kind, density, d_model, block, isa, threads):
    d_ff = 150  # 0.3 of it is 45 neurons: two chunks for two threads, and a last group of 1
    ffn = make_ffn(kind, d_model, d_ff, block, seed=d_model + block)
    assert kernels.in_c(ffn)  # the C kernel, not numba
    for seed in range(2):
        idx = active_set(d_ff, density, seed)
        x = torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
        out, want = torch.full((d_model,), float("nan")), torch.empty(d_model)
        assert kernels.sparse_ffn(x, ffn, idx, out) is out
        sparse_ffn_ref(ref_x(ffn, x), ffn, idx, want)
        torch.testing.assert_close(out, want, rtol=0, atol=tolerance(ffn, x, idx))
        # several tokens, one (union) active set: each row as the reference's
        X = torch.randn(5, d_model, generator=torch.Generator().manual_seed(seed + 7))
        got, want_b = torch.full((5, d_model), float("nan")), torch.empty(5, d_model)
        kernels.sparse_ffn_batch(X, ffn, idx, got)
        sparse_ffn_batch_ref(ref_x(ffn, X), ffn, idx, want_b)
        for t in range(5):
            torch.testing.assert_close(got[t], want_b[t], rtol=0, atol=tolerance(ffn, X[t], idx))


def test_relu_groups_that_do_not_fire_add_nothing():
    """A ReLU FFN whose up rows all come out negative: the kernel skips the down rows and the
    output is exactly 0, as the reference's."""
    ffn = make_ffn("relu", 64, 20, 32, seed=3)
    ffn = PackedFFN(ffn.kind, "int8", ffn.d_model, ffn.d_ff, ffn.rows, ffn.scales, ffn.block,
                    torch.full((20,), -1e4))
    out = torch.full((64,), float("nan"))
    kernels.sparse_ffn(torch.randn(64), ffn, torch.arange(20, dtype=torch.int32), out)
    assert torch.equal(out, torch.zeros(64))


def test_other_blocks_stay_in_numba_and_agree():
    """Blocks that are not a multiple of 8 take the numba kernel; both agree where both run."""
    odd = make_ffn("swiglu", 60, 30, 12, seed=0)
    assert not kernels.in_c(odd)
    ffn = make_ffn("swiglu", 64, 30, 32, seed=0)
    idx, x = active_set(30, 0.5, 0), torch.randn(64)
    c_out, nb_out = torch.empty(64), torch.empty(64)
    kernels.sparse_ffn(x, ffn, idx, c_out)
    kernels._run_ffn(ref_x(ffn, x).numpy().reshape(1, -1), ffn, idx.numpy(),
                     nb_out.numpy().reshape(1, -1))
    torch.testing.assert_close(c_out, nb_out, rtol=0, atol=tolerance(ffn, x, idx))


@pytest.mark.parametrize("kind", ["swiglu", "reglu"])
def test_round_x_chooses_the_products(kind, isa):
    """round_x=False keeps x in float32 where blocks of 32 would round it: the float reference
    then, and the rounded one with round_x=True (the default for these blocks)."""
    ffn = make_ffn(kind, 128, 40, 32, seed=5)
    kc = FFN_KINDS[kind]
    ga = kernels.ACT_CODES[kc.gate_act] if kc.gated else 0
    idx = active_set(40, 0.5, 1)
    X = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    for round_x, xr in ((False, X), (True, ref_x(ffn, X)), (None, ref_x(ffn, X))):
        got, want = torch.empty(3, 128), torch.empty(3, 128)
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, kc.gated, idx, X, got, ga,
                          kernels.ACT_CODES[kc.up_act], ffn.up_bias, round_x=round_x)
        sparse_ffn_batch_ref(xr, ffn, idx, want)
        for t in range(3):
            torch.testing.assert_close(got[t], want[t], rtol=0, atol=tolerance(ffn, X[t], idx))
    assert kernels.rounds_x(ffn) and not torch.equal(ref_x(ffn, X), X)  # two paths told apart


def test_sparse_i8_errors():
    ffn = make_ffn("swiglu", 64, 8, 32, seed=0)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    x, out = torch.zeros(1, 64), torch.empty(1, 64)
    with pytest.raises(IndexError, match=r"expected neuron indices in \[0, 8\)"):
        kernels.sparse_ffn(torch.zeros(64), ffn, torch.tensor([1, 8], dtype=torch.int32),
                           torch.empty(64))
    with pytest.raises(ValueError, match="block, d_model: expected multiples of 8"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 12, True, idx, x, out, 2, 0)
    with pytest.raises(ValueError, match=r"scales: expected contiguous float32 \[8, 3, 4\]"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 16, True, idx, x, out, 2, 0)
    with pytest.raises(ValueError, match=r"rows: expected contiguous int8 \[d_ff, 2, d_model\]"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, False, idx, x, out, 0, 1)
    with pytest.raises(ValueError, match="round_x: block and d_model must be multiples of 32"):
        cpu.sparse_ffn_i8(ffn.rows, torch.ones(8, 3, 8), 8, True, idx, x, out, 2, 0,
                          round_x=True)
    with pytest.raises(ValueError, match=r"x: expected float32 \[T, 64\]"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, True, idx, torch.zeros(64), out, 2, 0)
