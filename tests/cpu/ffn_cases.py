"""Random FFN weights bundled for the sparse kernels' tests."""

from __future__ import annotations

import math

import torch

from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN


def random_ffn(kind: str, d_model: int, d_ff: int, seed: int, dtype: str,
               block: int = 0) -> PackedFFN:
    """Gate (gated kinds), up and down of unit-variance outputs, an up bias for ungated kinds,
    bundled as ``dtype`` rows (int8: a scale per ``block`` weights, 0 = per row)."""
    g = torch.Generator().manual_seed(seed)
    gated = FFN_KINDS[kind].gated
    gate = torch.randn(d_ff, d_model, generator=g) / math.sqrt(d_model) if gated else None
    up = torch.randn(d_ff, d_model, generator=g) / math.sqrt(d_model)
    down = torch.randn(d_model, d_ff, generator=g) / math.sqrt(d_ff)
    bias = None if gated else torch.randn(d_ff, generator=g) * 0.1
    return PackedFFN.from_dense(kind, gate, up, down, up_bias=bias, dtype=dtype, block=block)


def ref_x(ffn: PackedFFN, x: torch.Tensor) -> torch.Tensor:
    """The x whose products the C kernel sums for ``ffn``'s gate/up rows: rounded to int8 per 32
    where it rounds (``kernels.rounds_x``), else as is."""
    return cpu_ref.rounded_x(x) if kernels.rounds_x(ffn) else x


def idx_of(d_ff: int, k: int, seed: int) -> torch.Tensor:
    """k of d_ff neurons drawn with ``seed``, ascending, int32."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(d_ff, generator=g)[:k])[0].to(torch.int32)


def assert_one_batch_masked(ffn: PackedFFN, X: torch.Tensor, idx: torch.Tensor, reference) -> None:
    """``kernels.sparse_ffn`` on X[0] (one token), ``sparse_ffn_batch`` on X, and on X with a
    random mask of idx, each token within ``reference(x, idx) -> (float64 out, tolerance)``."""
    d = ffn.d_model
    one = torch.full((d,), float("nan"))
    kernels.sparse_ffn(X[0], ffn, idx, one)
    want, tol = reference(X[0], idx)
    torch.testing.assert_close(one.double(), want, rtol=0, atol=tol)
    T = X.shape[0]
    got, got_m = torch.full((T, d), float("nan")), torch.full((T, d), float("nan"))
    kernels.sparse_ffn_batch(X, ffn, idx, got)
    mask = torch.rand(T, idx.numel(), generator=torch.Generator().manual_seed(5)) < 0.6
    kernels.sparse_ffn_batch(X, ffn, idx, got_m, mask)
    for t in range(T):
        want, tol = reference(X[t], idx)
        torch.testing.assert_close(got[t].double(), want, rtol=0, atol=tol)
        want, tol = reference(X[t], idx[mask[t]])
        torch.testing.assert_close(got_m[t].double(), want, rtol=0, atol=tol)


def batched_int8(kind: str, isa: str) -> bool:
    """Whether a call of several tokens over int8 rows of FFN ``kind`` takes the batched int8
    pass (``i8_batch`` in kernels.c: AVX-512, a gate that is not ReLU), whose sums run in another
    order than a one-token call's."""
    return isa == "avx512" and kind in ("swiglu", "geglu")
