"""Pure-torch references for ``sparseinfer.cpu`` (same signatures), with gguf-py's own
``gguf.quants.dequantize`` as the independent decoder of the blocks.

``gemv_ref``/``gemm_ref`` multiply the dequantized weights by the float32 input (what the
kernels approximate: they round ``x`` to int8 blocks first). ``gemv_q8_ref`` rounds ``x`` exactly
as the kernels do (``quantize_x_ref``), so it should match them to float32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
import torch

from .ops import QuantMatrix


def dequantize_ref(mat: QuantMatrix) -> torch.Tensor:
    """The float32 weights [rows, cols] of ``mat``, decoded by gguf-py."""
    raw = mat.raw.numpy() if isinstance(mat.raw, torch.Tensor) else np.asarray(mat.raw)
    qtype = gguf.GGMLQuantizationType[mat.type_name]
    w = gguf.quants.dequantize(raw.reshape(mat.rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(mat.rows, mat.cols)


def quantize_x_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [cols] -> (int8 q [cols], d [cols/32], s [cols/32]): per block of 32,
    ``d = max|x| / 127``, ``q = round_half_even(x · (1/d))`` (0 if d = 0), ``s = d · sum(q)``."""
    xb = x.float().reshape(-1, 32)
    d = xb.abs().amax(dim=1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[:, None])
    s = d * q.sum(dim=1)
    return q.to(torch.int8).reshape(-1), d, s


def _xq_float(x: torch.Tensor) -> torch.Tensor:
    q, d, _ = quantize_x_ref(x)
    return (q.double().reshape(-1, 32) * d.double()[:, None]).reshape(-1)


def gemv_ref(mats: Sequence[QuantMatrix], x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """``outs[i] = dequantize(mats[i]) @ x`` (float64 sums, float32 results)."""
    for m, o in zip(mats, outs):
        o.copy_(torch.as_tensor(dequantize_ref(m).double() @ x.double()))


def gemv_q8_ref(mats: Sequence[QuantMatrix], x: torch.Tensor,
                outs: Sequence[torch.Tensor]) -> None:
    """As ``gemv_ref`` with ``x`` first rounded to int8 blocks as the kernels round it (F16
    weights use ``x`` as is, as the kernels do)."""
    for m, o in zip(mats, outs):
        xv = x.double() if m.type_name == "F16" else _xq_float(x)
        o.copy_(torch.as_tensor(dequantize_ref(m).double() @ xv))


def gemm_ref(mat: QuantMatrix, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(mat).T`` for ``x`` [T, cols]: [T, rows]."""
    y = (x.double() @ dequantize_ref(mat).double().t()).float()
    if out is not None:
        out.copy_(y)
        return out
    return y
