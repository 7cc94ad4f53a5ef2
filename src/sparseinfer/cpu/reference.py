"""Pure-torch references for ``sparseinfer.cpu`` (same signatures), with gguf-py's own
``gguf.quants.dequantize`` as the independent decoder of the blocks.

``gemv_ref``/``gemm_ref`` multiply the dequantized weights by the float32 input (what the
kernels approximate: they round ``x`` to int8 blocks first). ``gemv_q8_ref`` rounds ``x`` exactly
as the kernels do (``quantize_x_ref``: blocks of 32; ``quantize_xk_ref``: blocks of 128, which
plain AVX2's Q6_K and AVX-512's Q5_K/Q6_K kernels take; ``x_block`` says which), so it should
match them to float32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
import torch

from .ops import QuantMatrix, get_isa


def dequantize_ref(mat: QuantMatrix) -> torch.Tensor:
    """The float32 weights [rows, cols] of ``mat``, decoded by gguf-py."""
    qtype = gguf.GGMLQuantizationType[mat.file_type]
    w = gguf.quants.dequantize(mat.file_rows(), qtype)
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


def quantize_xk_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [cols] -> (int8 q [cols], d [cols/128], int16 sums of q per 16 [cols/16]): per
    block of 128 as ``quantize_x_ref`` per block of 32."""
    xb = x.float().reshape(-1, 128)
    d = xb.abs().amax(dim=1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[:, None]).reshape(-1)
    return q.to(torch.int8), d, q.reshape(-1, 16).sum(dim=1).to(torch.int16)


def x_block(type_name: str) -> int:
    """The block of x (32 or 128 elements, one scale each) the active kernels round ``x`` in for
    weights of ``type_name``: 128 for Q6_K on 256-bit AVX2 (with or without AVX-VNNI) and
    AVX-512, for Q5_K on AVX-512 and for Q6_K panels (either layout), else 32."""
    isa = get_isa()
    if (type_name == "Q6_K" and isa in ("avx2", "avx2_vnni", "avx512")) or (
            type_name == "Q5_K" and isa == "avx512"):
        return 128
    if type_name in ("Q6_Kx16", "Q6_Kx16b"):  # every ISA's kernels
        return 128
    return 32


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` [..., cols] as the kernels see it after ``quantize_x_ref``: q · d per row."""
    rows = x.float().reshape(-1, x.shape[-1])
    return torch.stack([_xq_float(r).float() for r in rows]).reshape(x.shape)


def _xq_float(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    q, d, _ = quantize_x_ref(x) if block == 32 else quantize_xk_ref(x)
    return (q.double().reshape(-1, block) * d.double()[:, None]).reshape(-1)


def gemv_ref(mats: Sequence[QuantMatrix], x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """``outs[i] = dequantize(mats[i]) @ x`` (float64 sums, float32 results)."""
    for m, o in zip(mats, outs):
        o.copy_(torch.as_tensor(dequantize_ref(m).double() @ x.double()))


def gemv_q8_ref(mats: Sequence[QuantMatrix], x: torch.Tensor,
                outs: Sequence[torch.Tensor]) -> None:
    """As ``gemv_ref`` with ``x`` first rounded to int8 blocks as the kernels round it (F16/F32
    weights use ``x`` as is, as the kernels do)."""
    for m, o in zip(mats, outs):
        xv = (x.double() if m.type_name in ("F16", "BF16", "F32")
              else _xq_float(x, x_block(m.type_name)))
        o.copy_(torch.as_tensor(dequantize_ref(m).double() @ xv))


def gemm_ref(mat: QuantMatrix, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(mat).T`` for ``x`` [T, cols]: [T, rows]."""
    y = (x.double() @ dequantize_ref(mat).double().t()).float()
    if out is not None:
        out.copy_(y)
        return out
    return y


def gemm_each_ref(mats: Sequence[QuantMatrix], x: torch.Tensor, counts: Sequence[int],
                  outs: Sequence[torch.Tensor]) -> None:
    """``outs[i] = x_i @ dequantize(mats[i]).T``, ``x_i`` the next ``counts[i]`` rows of ``x``."""
    at = 0
    for m, c, o in zip(mats, counts, outs):
        gemm_ref(m, x[at:at + c], o)
        at += c


def gemv_each_ref(mats: Sequence[QuantMatrix], x: torch.Tensor,
                  outs: Sequence[torch.Tensor]) -> None:
    """``outs[i] = dequantize(mats[i]) @ x[i]``."""
    gemm_each_ref(mats, x, [1] * len(mats), [o.view(1, -1) for o in outs])


_ACTS = {None: lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu,
         "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def block_decode_ref(*, d_model, n_heads, n_kv_heads, head_dim, d_ff, gated, gate_act, up_act,
                     interleaved, eps, attn_norm, ffn_norm, qkv, wo, w_in, down, biases=None,
                     q_norm=None, k_norm=None, attn_post_norm=None, ffn_post_norm=None,
                     window=0, scale=None, softcap=0.0, x, pos, k_cache, v_cache, cos, sin,
                     ffn=None, residual=1.0) -> torch.Tensor:
    """``DecodeBlock(...)(x, pos, k_cache, v_cache, cos, sin)`` in float64 torch: each product is
    ``gemv_q8_ref`` (the input rounded as the kernels round it), attention a plain softmax over
    the cache with rope applied to q and k (the scores soft-capped when ``softcap``). Returns
    the new ``x``; writes the caches. ``ffn`` (a sparse FFN's reference): ``ffn(h, x)`` of the
    FFN's normed input and the residual stream (float64 [d_model]) replaces ``w_in``/``down``'s
    FFN, the down bias still added. ``residual`` multiplies both branches' outputs before their
    residual adds."""
    biases = biases or {}
    nh, nkv, hd = n_heads, n_kv_heads, head_dim

    def lin(name, mats, v):
        outs = [torch.empty(m.rows) for m in mats]
        gemv_q8_ref(mats, v.float().contiguous(), outs)
        y = torch.cat(outs).double()
        return y + biases[name].double() if biases.get(name) is not None else y

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean() + eps) * w.double()

    def rope(v):  # v (heads, hd)
        half = hd // 2
        c, s = cos.double(), sin.double()
        if interleaved:
            a, b = v[:, 0::2], v[:, 1::2]
            return torch.stack([a * c[:half] - b * s[:half], b * c[:half] + a * s[:half]],
                               -1).flatten(1)
        return v * c + torch.cat([-v[:, half:], v[:, :half]], -1) * s

    x = x.double()
    y = lin("qkv", qkv, norm(x, attn_norm))
    q, k, v = y.split([nh * hd, nkv * hd, nkv * hd])
    q, k = q.view(nh, hd), k.view(nkv, hd)
    if q_norm is not None:
        q = torch.stack([norm(head, q_norm) for head in q])
    if k_norm is not None:
        k = torch.stack([norm(head, k_norm) for head in k])
    q, k = rope(q), rope(k)
    k_cache[:, pos] = k.float()
    v_cache[:, pos] = v.view(nkv, hd).float()
    start = max(0, pos + 1 - window) if window else 0
    keys = k_cache[:, start : pos + 1].double().repeat_interleave(nh // nkv, 0)
    vals = v_cache[:, start : pos + 1].double().repeat_interleave(nh // nkv, 0)
    s = scale if scale else hd**-0.5
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * s
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores, -1)  # (nh, n)
    att = (probs.unsqueeze(1) @ vals).reshape(nh * hd)
    a = lin("wo", wo, att)
    x = x + residual * (norm(a, attn_post_norm) if attn_post_norm is not None else a)
    if ffn is not None:
        y = ffn(norm(x, ffn_norm), x).double()
        y = y + biases["down"].double() if biases.get("down") is not None else y
        return (x + residual * (norm(y, ffn_post_norm) if ffn_post_norm is not None
                                else y)).float()
    f = lin("w_in", w_in, norm(x, ffn_norm))
    if gated:
        h = _ACTS[gate_act](f[:d_ff]) * _ACTS[up_act](f[d_ff:])
    else:
        h = _ACTS[up_act](f)
    y = lin("down", down, h)
    return (x + residual * (norm(y, ffn_post_norm) if ffn_post_norm is not None else y)).float()
