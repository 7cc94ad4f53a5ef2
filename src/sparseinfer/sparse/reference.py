"""Pure-torch references for the neuron-aware operators in ``kernels.py`` (same signatures).

Slow (they copy the active rows) but short enough to read as the definition:

    h_i = act_gate(gate_i · x) * act_up(up_i · x)      gated kinds
    h_i = act_up(up_i · x + b_i)                       ungated kinds
    y   = sum_{i in idx} h_i * down_t[i]               (the caller adds the down bias)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config import FFN_KINDS
from .packed import PackedFFN

log = logging.getLogger(__name__)

# Activation by name (FFNKind.gate_act / up_act); GELU is torch's default (erf) form.
ACTS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    None: lambda z: z,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}


def check_ffn_args(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor) -> None:
    """Shared argument checks of ``sparse_ffn`` / ``sparse_ffn_ref`` (cheap: no tensor ops)."""
    d = ffn.d_model
    if x.dtype != torch.float32 or x.shape != (d,):
        raise ValueError(f"x: expected float32 [{d}], got {x.dtype} {list(x.shape)}")
    if out.dtype != torch.float32 or out.shape != (d,) or not out.is_contiguous():
        raise ValueError(
            f"out: expected contiguous float32 [{d}], got {out.dtype} {list(out.shape)}"
        )
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or idx.shape[0] > ffn.d_ff:
        raise ValueError(
            f"idx: expected int32/int64 [k] with k <= {ffn.d_ff}, got {idx.dtype} {list(idx.shape)}"
        )


def neuron_coefs(x: torch.Tensor, ffn: PackedFFN, rows: torch.Tensor, bias: torch.Tensor | None):
    """h for bundled fp32 ``rows`` ``[k, n_mats, d]`` and inputs ``x`` ``[..., d]``: ``[..., k]``."""
    kind = FFN_KINDS[ffn.kind]
    if kind.gated:
        return ACTS[kind.gate_act](x @ rows[:, 0].t()) * ACTS[kind.up_act](x @ rows[:, 1].t())
    z = x @ rows[:, 0].t()
    if bias is not None:
        z = z + bias
    return ACTS[kind.up_act](z)


def sparse_ffn_ref(
    x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[:] = sum_{i in idx} h_i(x) * down_t[i]``; x, out ``[d_model]`` fp32; returns out."""
    check_ffn_args(x, ffn, idx, out)
    idx = idx.long()
    rows = ffn.rows_fp32(idx)  # [k, n_mats, d]
    bias = None if ffn.up_bias is None else ffn.up_bias.index_select(0, idx)
    h = neuron_coefs(x, ffn, rows, bias)  # [k]
    out.copy_(h @ rows[:, -1])
    return out


def check_batch_args(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor,
                     masked: bool = False) -> None:
    """Checks of ``sparse_ffn_batch`` / ``sparse_ffn_batch_ref``; ``masked``: with a per-token
    mask, whose masked places may hold any row (never read), the list may outgrow d_ff."""
    d = ffn.d_model
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"x: expected float32 [T, {d}], got {x.dtype} {list(x.shape)}")
    if out.dtype != torch.float32 or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(
            f"out: expected contiguous float32 {list(x.shape)}, got {out.dtype} {list(out.shape)}"
        )
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or (
            idx.shape[0] > ffn.d_ff and not masked):
        raise ValueError(
            f"idx: expected int32/int64 [k] with k <= {ffn.d_ff}, got {idx.dtype} {list(idx.shape)}"
        )


def sparse_ffn_batch_ref(
    x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Batched ``sparse_ffn_ref``: x, out ``[T, d_model]``, one (union) active set."""
    check_batch_args(x, ffn, idx, out)
    idx = idx.long()
    rows = ffn.rows_fp32(idx)
    bias = None if ffn.up_bias is None else ffn.up_bias.index_select(0, idx)
    h = neuron_coefs(x, ffn, rows, bias)  # [T, k]
    out.copy_(h @ rows[:, -1])
    return out


def predict_active_ref(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float, out_idx: torch.Tensor,
    *, neuron_thresholds: torch.Tensor | None = None,
) -> int:
    """Neurons whose predictor logit ``fc2 @ relu(fc1 @ x)`` is >= threshold, ascending.

    Writes them into ``out_idx[:k]`` (int32, length >= d_ff) and returns k.
    """
    check_predict_args(x, fc1, fc2, out_idx)
    logits = fc2.float() @ torch.relu(fc1.float() @ x)
    thr = threshold if neuron_thresholds is None else neuron_thresholds
    sel = torch.nonzero(logits >= thr).reshape(-1)
    k = int(sel.numel())
    out_idx[:k] = sel.to(torch.int32)
    return k


def check_predict_args(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, out_idx: torch.Tensor
) -> None:
    if fc1.dim() != 2 or fc2.dim() != 2 or fc2.shape[1] != fc1.shape[0]:
        raise ValueError(
            f"fc1/fc2: expected [r, d_model] and [d_ff, r], got {list(fc1.shape)} {list(fc2.shape)}"
        )
    for name, t in (("fc1", fc1), ("fc2", fc2)):
        if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous float32 or bfloat16, got {t.dtype}")
    if fc1.dtype != fc2.dtype:
        raise ValueError(f"fc1/fc2: expected one dtype, got {fc1.dtype} and {fc2.dtype}")
    if x.dtype != torch.float32 or x.shape != (fc1.shape[1],):
        raise ValueError(f"x: expected float32 [{fc1.shape[1]}], got {x.dtype} {list(x.shape)}")
    if out_idx.dtype != torch.int32 or out_idx.dim() != 1 or out_idx.shape[0] < fc2.shape[0]:
        raise ValueError(
            f"out_idx: expected int32 [>= {fc2.shape[0]}], "
            f"got {out_idx.dtype} {list(out_idx.shape)}"
        )


def dense_ffn_ref(x: torch.Tensor, ffn: PackedFFN, out: torch.Tensor) -> torch.Tensor:
    """All neurons with plain torch matmuls on the fp32 dequantized weights (no caching)."""
    gate, up, down = ffn.dequantized()
    kind = FFN_KINDS[ffn.kind]
    z = F.linear(x, up, ffn.up_bias)
    h = ACTS[kind.up_act](z)
    if gate is not None:
        h = ACTS[kind.gate_act](F.linear(x, gate)) * h
    out.copy_(F.linear(h, down))
    return out
