"""Quantized projections for the dense parts: 4-bit blocks (attention, dense FFN) and an int8
LM head, each a drop-in for a bias-free or biased ``nn.Linear`` on the CPU.

Both run on torch's own CPU kernels for weight-only quantization, which take bfloat16
activations: ``torch._weight_int4pack_mm_for_cpu`` (groups of 32, per-group scale and zero, so a
Q4_0/Q4_1 block maps onto it exactly: ``(q − 8) · scale + zero`` with ``zero = offset + 8 ·
scale``; the scales are rounded to bfloat16) and ``torch._weight_int8pack_mm`` (per-row scales).
Activations are rounded to bfloat16 on the way in (llama.cpp rounds them to 8 bits for its
quantized dot products); results come back as float32. The reference for each is ``F.linear``
on the dequantized weights (``reference`` below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import SparseInferError
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


class Int8Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` quantized per row, symmetric absmax int8 (CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _need_cpu_op("_weight_int8pack_mm")
        w = weight.detach().float()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(ACT_DTYPE)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch._weight_int8pack_mm(x2, self.q, self.scale).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]


def reference(module: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``module(x)`` computes, in plain torch: bfloat16-rounded input times the
    dequantized weights in float32."""
    return F.linear(x.to(ACT_DTYPE).float(), module.dequantized(), module.bias)
