"""Quantized projections for the dense parts: 4-bit blocks (attention, dense FFN) and an int8
LM head, each a drop-in for a bias-free or biased ``nn.Linear`` on the CPU.

4-bit: torch's own CPU kernel for weight-only quantization, ``torch._weight_int4pack_mm_for_cpu``
(groups of 32, per-group scale and zero, so a Q4_0/Q4_1 block maps onto it exactly: ``(q − 8) ·
scale + zero`` with ``zero = offset + 8 · scale``; the scales are rounded to bfloat16). It takes
bfloat16 activations (llama.cpp rounds them to 8 bits for its quantized dot products); results
come back as float32. int8: one token through ``gemv_int8`` (numba, fp32 activations, ≈2× torch's
int8 kernel on this machine: the head is the largest single matrix), batches through
``torch._weight_int8pack_mm`` (bfloat16 activations). The reference for each is ``F.linear`` on
the dequantized weights (``reference``, ``gemv_int8_ref``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import prange

from ..errors import SparseInferError
from ..sparse.kernels import _jit, get_threads
from .blocks import GROUP, Q4Blocks

ACT_DTYPE = torch.bfloat16


def _need_cpu_op(name: str) -> None:
    if not hasattr(torch, name):
        raise SparseInferError(f"4-bit/8-bit weights need torch.{name} (torch >= 2.5), found "
                               f"torch {torch.__version__}")


class Int4Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` held as 4-bit blocks (CPU)."""

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None = None):
        super().__init__()
        _need_cpu_op("_weight_int4pack_mm_for_cpu")
        n, k = blocks.shape
        self.in_features, self.out_features = k, n
        self.packed = torch._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
        zero = blocks.offset + 8.0 * blocks.scale
        # (k / 32, n, 2): per group and output row, (scale, zero)
        self.scales_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1).to(ACT_DTYPE)
        self.scales_zeros = self.scales_zeros.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weights this module multiplies by, as float32 (bfloat16-rounded scales)."""
        eye = torch.eye(self.in_features, dtype=ACT_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP,
                                                 self.scales_zeros).float().t().contiguous()


@_jit()
def _int8_rows(q, scale, x, start, end, y):  # pragma: no cover - compiled
    k = x.shape[0]
    for r in range(start, end):
        qr = q[r]
        acc = np.float32(0.0)
        for j in range(k):
            acc += np.float32(qr[j]) * x[j]
        y[r] = acc * scale[r]


@_jit(parallel=True)
def _int8_gemv_kernel(q, scale, x, n_chunks, y):  # pragma: no cover - compiled
    n = q.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _int8_rows(q, scale, x, min(c * per, n), min((c + 1) * per, n), y)


def gemv_int8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """``out = (q · scale[:, None]) @ x`` for int8 ``q`` [n, k] (contiguous), float32 ``scale``
    [n], ``x`` [k] and ``out`` [n]: fp32 activations, one streaming pass split over the kernel
    threads (reference: ``gemv_int8_ref``)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"q: expected contiguous int8 [n, k], got {q.dtype} {list(q.shape)}")
    n, k = q.shape
    for name, t, shape in (("scale", scale, (n,)), ("x", x, (k,)), ("out", out, (n,))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous float32 {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    _int8_gemv_kernel(q.numpy(), scale.numpy(), x.numpy(), get_threads() * 4, out.numpy())
    return out


@_jit()
def _int8_rows_batch(q, scale, x, start, end, y):  # pragma: no cover - compiled
    k = x.shape[1]
    w = np.empty(k, dtype=np.float32)
    for r in range(start, end):
        qr = q[r]  # read once from memory, widened once, reused for every input row
        for j in range(k):
            w[j] = np.float32(qr[j])
        for b in range(x.shape[0]):
            xb = x[b]
            acc = np.float32(0.0)
            for j in range(k):
                acc += w[j] * xb[j]
            y[b, r] = acc * scale[r]


@_jit(parallel=True)
def _int8_gemm_kernel(q, scale, x, n_chunks, y):  # pragma: no cover - compiled
    n = q.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _int8_rows_batch(q, scale, x, min(c * per, n), min((c + 1) * per, n), y)


def gemm_int8_rows(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(q · scale[:, None]) @ x.T`` -> [B, n] for a few fp32 rows ``x`` [B, k]: ``gemv_int8``'s
    arithmetic for every row (each output computed the same way whatever B is), with each weight
    row streamed from memory once for all B rows (reference: ``gemv_int8_ref`` per row)."""
    if x.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"x: expected [B, {q.shape[1]}], got {list(x.shape)}")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], q.shape[0])
    _int8_gemm_kernel(q.numpy(), scale.numpy(), x.numpy(), get_threads() * 4, out.numpy())
    return out


def gemv_int8_ref(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale[:, None]) @ x


class Int8Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` quantized per row, symmetric absmax int8 (CPU). One token
    goes through ``gemv_int8`` (fp32 activations), batches through torch's int8 kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _need_cpu_op("_weight_int8pack_mm")
        w = weight.detach().float()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale32 = scale.contiguous()
        self.scale = scale.to(ACT_DTYPE)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._out = torch.empty(self.out_features)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, in] -> [B, out] through ``gemm_int8_rows`` (fp32 activations, weights read once;
        a row's result does not depend on B). For decoding a few sequences at once."""
        y = gemm_int8_rows(self.q, self.scale32, x)
        if self.bias is not None:
            y += self.bias
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == self.in_features and x.dtype == torch.float32:
            y = gemv_int8(self.q, self.scale32, x.reshape(-1).contiguous(), self._out).clone()
            if self.bias is not None:
                y += self.bias
            return y.view(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch._weight_int8pack_mm(x2, self.q, self.scale).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """Float32 weights of the batch path (bfloat16-rounded scales; one token uses the
        float32 scales)."""
        return self.q.float() * self.scale.float()[:, None]


def reference(module: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``module(x)`` computes, in plain torch: bfloat16-rounded input times the
    dequantized weights in float32."""
    return F.linear(x.to(ACT_DTYPE).float(), module.dequantized(), module.bias)
