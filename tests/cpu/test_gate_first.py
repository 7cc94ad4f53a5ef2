"""ReLU gates first (ReGLU, dReLU): a neuron whose gate comes out <= 0 has h = 0 whatever its up
row holds, so the C sparse kernels (q4 and int8 bundles) never read that row, and the numba
kernel skips the up rows of a group of 4 whose gates are all silent.
Checked by poisoning: NaN scales in the up rows of the neurons whose gate is clearly negative
must leave every output as it is (a read would make h = 0 * NaN = NaN), for single tokens,
batches, per-token masks, every ISA and thread count here (the kernels before this path fail
it); and the outputs stay close to the reference's."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN
from sparseinfer.sparse.reference import sparse_ffn_batch_ref

from .ffn_cases import ref_x

D_MODEL, D_FF = 128, 72


def ffn_with_signed_gates(kind: str, dtype: str, x: torch.Tensor) -> tuple[PackedFFN, torch.Tensor]:
    """Gates whose products with every row of x are about +-4 (far from 0 under any rounding):
    neuron i fires when i % 3 == 0. Returns the FFN and the neurons whose gates do not fire."""
    g = torch.Generator().manual_seed(3)
    d = x.mean(dim=0)
    sign = torch.tensor([1.0 if i % 3 == 0 else -1.0 for i in range(D_FF)])
    gate = torch.outer(sign, d) * (4.0 / (d @ d)) + 0.01 * torch.randn(D_FF, D_MODEL, generator=g)
    up = torch.randn(D_FF, D_MODEL, generator=g) / math.sqrt(D_MODEL)
    down = torch.randn(D_MODEL, D_FF, generator=g) / math.sqrt(D_FF)
    ffn = PackedFFN.from_dense(kind, gate, up, down, dtype=dtype, block=32 if dtype == "int8" else 0)
    return ffn, torch.nonzero(sign < 0).flatten()


def poison_up_rows(ffn: PackedFFN, silent: torch.Tensor) -> PackedFFN:
    """The same FFN with NaN scales in the up rows of ``silent`` neurons."""
    rows, scales = ffn.rows.clone(), None if ffn.scales is None else ffn.scales.clone()
    if ffn.dtype == "q4":  # q4 rows: the blocks' float16 scales first; 0x7E00 is NaN
        for b in range(D_MODEL // 32):
            rows[silent, 1, 2 * b] = 0x00
            rows[silent, 1, 2 * b + 1] = 0x7E
    else:
        scales[silent, 1] = float("nan")
    return replace(ffn, rows=rows, scales=scales)


@pytest.mark.parametrize("dtype", ["q4", "int8"])
@pytest.mark.parametrize("T", [1, 3, 20])
def test_up_rows_of_silent_gates_are_not_read(dtype, T, isa, threads):
    """ReGLU (dReLU takes the same path, but its relu(up) would turn a NaN read into 0 and hide
    it: its results are checked against the reference in test_sparse_q4/_i8)."""
    x = torch.randn(T, D_MODEL, generator=torch.Generator().manual_seed(T)) + 1.0
    ffn, silent = ffn_with_signed_gates("reglu", dtype, x)
    assert kernels.in_c(ffn)
    poisoned = poison_up_rows(ffn, silent)
    idx = torch.arange(D_FF, dtype=torch.int32)
    want = kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(T, D_MODEL))
    got = kernels.sparse_ffn_batch(x, poisoned, idx, torch.full((T, D_MODEL), float("nan")))
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    ref = sparse_ffn_batch_ref(ref_x(ffn, x), ffn, idx, torch.empty(T, D_MODEL))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # one token at a time and with per-token sets (a mask), the same rows stay unread
    one, want_one = torch.empty(D_MODEL), torch.empty(D_MODEL)
    kernels.sparse_ffn(x[0].contiguous(), poisoned, idx, one)
    kernels.sparse_ffn(x[0].contiguous(), ffn, idx, want_one)
    assert torch.equal(one, want_one)
    mask = torch.rand(T, D_FF, generator=torch.Generator().manual_seed(0)) < 0.5
    got_m = kernels.sparse_ffn_batch(x, poisoned, idx, torch.empty(T, D_MODEL), mask)
    want_m = kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(T, D_MODEL), mask)
    assert torch.isfinite(got_m).all() and torch.equal(got_m, want_m)


def test_swiglu_reads_every_up_row():
    """The control: SiLU gates are never exactly 0, so the same poison reaches the output."""
    x = torch.randn(2, D_MODEL, generator=torch.Generator().manual_seed(1)) + 1.0
    ffn, silent = ffn_with_signed_gates("swiglu", "int8", x)
    got = kernels.sparse_ffn_batch(x, poison_up_rows(ffn, silent),
                                   torch.arange(D_FF, dtype=torch.int32), torch.empty(2, D_MODEL))
    assert torch.isnan(got).all()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8-20"])  # int8 per 20: not the C kernel's
@pytest.mark.parametrize("T", [1, 3])
def test_numba_kernel_skips_groups_of_silent_gates(dtype, T):
    """The numba kernel (rows the C kernels do not take) goes 4 neurons at a time: the up rows
    of a group are read only if one of its 4 gates fired. Neurons 0..7 fire, the rest do not:
    poisoned up rows of the silent ones leave every output as it is."""
    x = torch.randn(T, D_MODEL, generator=torch.Generator().manual_seed(T)) + 1.0
    g = torch.Generator().manual_seed(3)
    d = x.mean(dim=0)
    sign = torch.tensor([1.0 if i < 8 else -1.0 for i in range(D_FF)])
    gate = torch.outer(sign, d) * (4.0 / (d @ d)) + 0.01 * torch.randn(D_FF, D_MODEL, generator=g)
    up = torch.randn(D_FF, D_MODEL, generator=g) / math.sqrt(D_MODEL)
    down = torch.randn(D_MODEL, D_FF, generator=g) / math.sqrt(D_FF)
    rows_dtype, block = ("int8", 20) if dtype == "int8-20" else (dtype, 0)
    ffn = PackedFFN.from_dense("reglu", gate, up, down, dtype=rows_dtype, block=block)
    assert not kernels.in_c(ffn)
    rows = ffn.rows.clone()
    scales = None if ffn.scales is None else ffn.scales.clone()
    if scales is not None:
        scales[8:, 1] = float("nan")
    else:
        rows[8:, 1] = float("nan")
    poisoned = replace(ffn, rows=rows, scales=scales)
    idx = torch.arange(D_FF, dtype=torch.int32)
    want = kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(T, D_MODEL))
    got = kernels.sparse_ffn_batch(x, poisoned, idx, torch.empty(T, D_MODEL))
    assert torch.isfinite(got).all() and torch.equal(got, want)
