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


def batched_int8(kind: str, isa: str) -> bool:
    """Whether a call of several tokens over int8 rows of FFN ``kind`` takes the batched int8
    pass (``i8_batch`` in kernels.c: AVX-512, a gate that is not ReLU), whose sums run in another
    order than a one-token call's."""
    return isa == "avx512" and kind in ("swiglu", "geglu")
