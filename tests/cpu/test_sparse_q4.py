"""Sparse FFN over q4 neuron bundles (``PackedFFN`` dtype "q4", C kernel) vs the pure-torch
reference on the same rows, and the q4 codec vs gguf-py's Q4_0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import (PackedFFN, dequantize_q4_0, dequantize_q4_rows, q4_blocks,
                                       q4_rows, quantize_q4_0, quantize_q4_rows)
from sparseinfer.sparse.reference import neuron_coefs, sparse_ffn_batch_ref, sparse_ffn_ref

from .ffn_cases import random_ffn

gguf = pytest.importorskip("gguf")
EPS = torch.finfo(torch.float32).eps


def make_ffn(kind: str, d_model: int, d_ff: int, seed: int) -> PackedFFN:
    return random_ffn(kind, d_model, d_ff, seed, "q4")


def active_set(d_ff: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = round(d_ff * density)
    return torch.sort(torch.randperm(d_ff, generator=g)[:k])[0].to(torch.int32)


def bound(ffn: PackedFFN, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """What rounding x to int8 blocks can move the output: propagate |x - q·d| <= d/2 through
    the gate/up dot products (first order, with the activations' slope <= 1.2) into the down
    rows, plus float32 summation slack."""
    rows = ffn.rows_fp32(idx.long())  # [k, n_mats, d]
    _, d, _ = cpu_ref.quantize_x_ref(x)
    step = d.repeat_interleave(32) / 2
    ins = rows[:, :-1].abs()  # gate/up rows
    dz = ins @ step + (ffn.d_model // 32 + 16) * EPS * (ins @ x.abs())  # [k, n_in]
    z = rows[:, :-1] @ x
    zmax = z.abs() + dz
    if FFN_KINDS[ffn.kind].gated:  # |d(a·b)| <= |da|·|b| + |a|·|db| + |da|·|db|
        dh = 1.2 * (dz[:, 0] * zmax[:, 1] + zmax[:, 0] * dz[:, 1] + dz[:, 0] * dz[:, 1]) * 1.2
    else:
        dh = 1.2 * dz[:, 0]
    h = neuron_coefs(x, ffn, rows, None if ffn.up_bias is None else ffn.up_bias[idx.long()])
    down = rows[:, -1].abs()
    return dh @ down + (idx.numel() + 16) * EPS * ((h.abs() + dh) @ down) + EPS


def test_q4_codec_matches_gguf():
    w = torch.randn(7, 96)
    raw = quantize_q4_0(w)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(raw.numpy(), want)
    deq = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(dequantize_q4_0(raw), torch.from_numpy(deq))
    # q4 rows: the same bytes, each row's scales first, then its blocks' quants
    rows = quantize_q4_rows(w)
    nb = 96 // 32
    assert torch.equal(rows[:, : 2 * nb].reshape(7, nb, 2), raw.reshape(7, nb, 18)[..., :2])
    assert torch.equal(rows[:, 2 * nb :].reshape(7, nb, 16), raw.reshape(7, nb, 18)[..., 2:])
    assert torch.equal(q4_blocks(rows), raw) and torch.equal(q4_rows(raw), rows)
    assert torch.equal(dequantize_q4_rows(rows), torch.from_numpy(deq))


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "relu", "reglu", "drelu"])  # relu gates: gates first
@pytest.mark.parametrize("density", [0.0, 0.1, 1.0])
# 2, 8, 5, 18, 20 blocks: scales 8 blocks at a time and one by one, AVX-512's groups (their
# scales 4 groups a chunk: 20 blocks = 5 groups, a second chunk of one) and their tail
@pytest.mark.parametrize("d_model,d_ff", [(64, 45), (256, 130), (160, 70), (576, 40), (640, 30)])
@pytest.mark.parametrize("isa", ["avx2", "avx2_vnni", "avx2_128", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_q4_matches_reference(kind, density, d_model, d_ff, isa, threads):
    if isa not in cpu.available_isas():
        pytest.skip(f"this CPU has no {isa}")
    cpu.set_isa(isa)
    before = cpu.get_threads()
    cpu.set_threads(threads)
    try:
        ffn = make_ffn(kind, d_model, d_ff, seed=d_ff)
        for seed in range(2):
            idx = active_set(d_ff, density, seed)
            x = torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
            out, want = torch.full((d_model,), float("nan")), torch.empty(d_model)
            kernels.sparse_ffn(x, ffn, idx, out)
            sparse_ffn_ref(x, ffn, idx, want)
            assert torch.all((out - want).abs() <= bound(ffn, x, idx))
            # batched: one union set for T tokens, each row as the single-token call
            X = torch.randn(3, d_model, generator=torch.Generator().manual_seed(seed + 7))
            got, want_b = torch.full((3, d_model), float("nan")), torch.empty(3, d_model)
            kernels.sparse_ffn_batch(X, ffn, idx, got)
            sparse_ffn_batch_ref(X, ffn, idx, want_b)
            for t in range(3):
                one = torch.empty(d_model)
                kernels.sparse_ffn(X[t].contiguous(), ffn, idx, one)
                assert torch.allclose(got[t], one, rtol=0, atol=8 * EPS * one.abs().max().item())
                assert torch.all((got[t] - want_b[t]).abs() <= bound(ffn, X[t], idx))
    finally:
        cpu.set_threads(before)
        cpu.set_isa("auto")


def test_q4_select_and_rows():
    ffn = make_ffn("swiglu", 64, 40, seed=0)
    assert ffn.rows.dtype == torch.uint8 and ffn.rows.shape == (40, 3, 64 // 32 * 18)
    assert ffn.bytes_per_neuron == 3 * 64 // 32 * 18
    pick = torch.tensor([5, 0, 39])
    sub = ffn.select(pick)
    assert torch.equal(sub.rows_fp32(), ffn.rows_fp32(pick))
    x = torch.randn(64)
    out, want = torch.empty(64), torch.empty(64)
    all_sub = torch.arange(3, dtype=torch.int32)
    kernels.sparse_ffn(x, sub, all_sub, out)
    kernels.sparse_ffn(x, ffn, pick.to(torch.int32), want)
    assert torch.allclose(out, want, rtol=0, atol=8 * EPS * want.abs().max().item())


def test_q4_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedFFN.from_dense("swiglu", torch.zeros(4, 48), torch.zeros(4, 48), torch.zeros(48, 4),
                             dtype="q4")
    ffn = make_ffn("swiglu", 64, 8, seed=0)
    with pytest.raises(IndexError, match=r"expected neuron indices in \[0, 8\)"):
        kernels.sparse_ffn(torch.zeros(64), ffn, torch.tensor([1, 8], dtype=torch.int32),
                           torch.empty(64))
