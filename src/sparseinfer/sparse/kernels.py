"""Fused numba kernels for the neuron-aware operators; references with the same signatures are in
``reference.py``. q4 rows, and int8 rows whose blocks are a multiple of 8 long, run in the C
library instead (``sparseinfer.cpu.sparse_ffn_q4`` / ``sparse_ffn_i8``, see ``in_c``; the C int8
kernel against numba's: benchmarks/RESULTS.md).

The sparse FFN splits the active list into one chunk per thread (``prange`` over chunks); each
chunk walks its neurons four at a time (the 4 neurons' gate and up dot products in one loop, 8
memory streams in flight, then their 4 down rows in one axpy loop) into that thread's slice of a
preallocated ``[n_threads, T, d_model]`` scratch, which is then summed into ``out``. Rows are read
in place (no gather copy), one contiguous bundle per neuron. bf16 rows are passed as uint16 and
widened by ``<< 16`` into float32 bits; int8 rows are multiplied by their scale once per block.
Everything accumulates in float32. Small calls (< ``SERIAL_BYTES`` of weights) run on the calling
thread only.

Threads: ``set_threads(n)`` (numba's setting for the calling thread, plus the chunk count; the C
kernels use the C library's pool, ``cpu.set_threads``). Scratch buffers are cached per calling
thread and grown on demand; no call allocates in the steady state. Compiled code is cached on
disk by numba (``cache=True``): the first import on a fresh checkout compiles for ~10-20 s, later
ones load in well under a second.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import NamedTuple

import numba
import numpy as np
import torch
import torch.nn.functional as F
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic, overload

from ..config import FFN_KINDS
from ..cpu import loads as cpu_loads
from ..threads import requested_kernel_threads
from .packed import PackedFFN, quantize_int8
from .reference import ACTS, check_batch_args, check_ffn_args, check_predict_args

log = logging.getLogger(__name__)

__all__ = [
    "DenseFFN",
    "dense_ffn",
    "dense_ffn_ref",
    "dense_weights",
    "gate_dots",
    "get_threads",
    "predict_active",
    "set_threads",
    "sparse_ffn",
    "sparse_ffn_batch",
    "sparse_ffn_predicted",
    "use_threads",
    "warmup",
]

# Reassociation (vectorised reductions) and FMA contraction, but keep inf/NaN semantics
# (``fastmath=True`` would also assume no inf/NaN, which silu/gelu of large inputs can produce).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# Activation codes, by FFNKind.gate_act / up_act name.
ACT_CODES: dict[str | None, int] = {None: 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4}


def _jit(**kw):
    """``njit`` with on-disk caching; if the cache dir is unusable, compile without it."""

    def deco(fn):
        try:
            return njit(cache=True, fastmath=FASTMATH, **kw)(fn)
        except Exception as e:  # pragma: no cover - depends on the install
            log.warning("numba cache unavailable for %s (%s); compiling uncached", fn.__name__, e)
            return njit(cache=False, fastmath=FASTMATH, **kw)(fn)

    return deco


# --------------------------------------------------------------------------- element loads


@intrinsic
def _bf16_bits_to_f32(typingctx, v):
    """uint16/int16 bf16 bits → float32 (``bits << 16`` reinterpreted)."""
    if not (isinstance(v, types.Integer) and v.bitwidth == 16):
        return None

    def codegen(context, builder, sig, args):
        w = builder.zext(args[0], ir.IntType(32))
        w = builder.shl(w, ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(w, ir.FloatType())

    return types.float32(v), codegen


def _f32(v):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_f32, inline="always")
def _f32_ov(v):
    if v == types.float32:
        return lambda v: v
    if isinstance(v, types.Integer) and v.bitwidth == 16:
        return lambda v: _bf16_bits_to_f32(v)
    if v == types.int8:
        return lambda v: np.float32(v)
    return None


@_jit(inline="always")
def _act(z, code):
    if code == 0:
        return z
    if code == 1:
        return max(z, np.float32(0.0))
    if code == 2:
        return np.float32(z / (1.0 + math.exp(-z)))
    if code == 4:  # tanh approximation (Gemma's gelu_pytorch_tanh)
        return np.float32(0.5 * z * (1.0 + math.tanh(0.7978845608028654
                                                      * (z + 0.044715 * z * z * z))))
    return np.float32(0.5 * z * (1.0 + math.erf(z * 0.7071067811865476)))


# --------------------------------------------------------------------------- sparse FFN core


@_jit(inline="always")
def _dots4(xt, r0, r1, r2, r3, scales, i0, i1, i2, i3, m, nb, block, scaled):
    """The dot products of 4 rows with xt, block by block (each block's sum times the rows'
    scale ``scales[i, m, blk]`` when scaled): one row kind of ``_walk``'s 4 neurons."""
    d = xt.shape[0]
    zero = np.float32(0.0)
    a0 = a1 = a2 = a3 = zero
    for blk in range(nb):
        lo = np.uint64(blk * block)
        hi = np.uint64(min(blk * block + block, d))
        p0 = p1 = p2 = p3 = zero
        for j in range(lo, hi):
            xj = xt[j]
            p0 += _f32(r0[j]) * xj
            p1 += _f32(r1[j]) * xj
            p2 += _f32(r2[j]) * xj
            p3 += _f32(r3[j]) * xj
        if scaled:
            p0 *= scales[i0, m, blk]
            p1 *= scales[i1, m, blk]
            p2 *= scales[i2, m, blk]
            p3 *= scales[i3, m, blk]
        a0 += p0
        a1 += p1
        a2 += p2
        a3 += p3
    return a0, a1, a2, a3


@_jit()
def _walk(x, rows, scales, bias, idx, mask, start, end, gated, ga, ua, block, acc):
    """acc[t] += sum_{c in [start, end)} h_t(idx[c]) * down_t[idx[c]] for each token t (with a
    ``mask`` ``[T, len(idx)]``: only where ``mask[t, c]`` is not 0; 0 rows: every neuron).

    x, acc: ``[T, d]``. Neurons go four at a time: their gate/up dot products in one loop, then
    their down rows in one axpy loop. With a ReLU gate the 4 gates go first and the up rows are
    read only if one of them fired (the C kernels skip per neuron). The group's rows are re-read
    from cache for tokens after the first. A last group of fewer than 4 repeats its first neuron with h forced to 0 (cached
    rows again), so there is a single code path. ``scales`` has 0 blocks when unscaled. Loops run
    over unsigned indices: with signed ones numba keeps negative-index wraparound, which stops
    LLVM from vectorising (5-10x slower).
    """
    T = x.shape[0]
    d = x.shape[1]
    nb = scales.shape[2]
    scaled = nb > 0
    if not scaled:
        nb = 1
        block = d
    m_up = 1 if gated else 0
    m_dn = 2 if gated else 1
    has_bias = bias.shape[0] > 0
    zero = np.float32(0.0)
    gate_first = gated and ga == 1  # ReLU gate (ACT_CODES["relu"])
    masked = mask.shape[0] > 0
    for c in range(start, end, 4):
        n_live = min(4, end - c)
        i0 = idx[c]
        i1 = idx[c + 1] if n_live > 1 else i0
        i2 = idx[c + 2] if n_live > 2 else i0
        i3 = idx[c + 3] if n_live > 3 else i0
        u0 = rows[i0, m_up]
        u1 = rows[i1, m_up]
        u2 = rows[i2, m_up]
        u3 = rows[i3, m_up]
        g0 = rows[i0, 0]
        g1 = rows[i1, 0]
        g2 = rows[i2, 0]
        g3 = rows[i3, 0]
        w0 = rows[i0, m_dn]
        w1 = rows[i1, m_dn]
        w2 = rows[i2, m_dn]
        w3 = rows[i3, m_dn]
        for t in range(T):
            # which of the 4 this token takes: those of the group (n_live), within its own set
            l0 = True
            l1 = n_live > 1
            l2 = n_live > 2
            l3 = n_live > 3
            if masked:
                mt = mask[t]
                l0 = mt[c] != 0
                l1 = l1 and mt[c + 1] != 0
                l2 = l2 and mt[c + 2] != 0
                l3 = l3 and mt[c + 3] != 0
                if not (l0 or l1 or l2 or l3):
                    continue
            xt = x[t]
            # --- up (and gate) dot products, 4 neurons interleaved
            a0 = a1 = a2 = a3 = zero  # up
            b0 = b1 = b2 = b3 = zero  # gate
            if gate_first:  # ReLU gates: the 4 gates alone; the up rows only if one fired
                b0, b1, b2, b3 = _dots4(xt, g0, g1, g2, g3, scales, i0, i1, i2, i3, 0, nb,
                                        block, scaled)
                if (b0 <= 0 or not l0) and (b1 <= 0 or not l1) and (b2 <= 0 or not l2) and \
                        (b3 <= 0 or not l3):
                    continue
            if not gated or gate_first:
                a0, a1, a2, a3 = _dots4(xt, u0, u1, u2, u3, scales, i0, i1, i2, i3, m_up, nb,
                                        block, scaled)
            else:  # gate and up rows in one loop: 8 streams
                for blk in range(nb):
                    lo = np.uint64(blk * block)
                    hi = np.uint64(min(blk * block + block, d))
                    p0 = p1 = p2 = p3 = zero
                    q0 = q1 = q2 = q3 = zero
                    for j in range(lo, hi):
                        xj = xt[j]
                        p0 += _f32(u0[j]) * xj
                        p1 += _f32(u1[j]) * xj
                        p2 += _f32(u2[j]) * xj
                        p3 += _f32(u3[j]) * xj
                        q0 += _f32(g0[j]) * xj
                        q1 += _f32(g1[j]) * xj
                        q2 += _f32(g2[j]) * xj
                        q3 += _f32(g3[j]) * xj
                    if scaled:
                        p0 *= scales[i0, m_up, blk]
                        p1 *= scales[i1, m_up, blk]
                        p2 *= scales[i2, m_up, blk]
                        p3 *= scales[i3, m_up, blk]
                        q0 *= scales[i0, 0, blk]
                        q1 *= scales[i1, 0, blk]
                        q2 *= scales[i2, 0, blk]
                        q3 *= scales[i3, 0, blk]
                    a0 += p0
                    a1 += p1
                    a2 += p2
                    a3 += p3
                    b0 += q0
                    b1 += q1
                    b2 += q2
                    b3 += q3
            if gate_first:  # a silent gate's h is 0 whatever its up row holds
                h0 = b0 * _act(a0, ua) if b0 > 0 else zero
                h1 = b1 * _act(a1, ua) if b1 > 0 else zero
                h2 = b2 * _act(a2, ua) if b2 > 0 else zero
                h3 = b3 * _act(a3, ua) if b3 > 0 else zero
            elif gated:
                h0 = _act(b0, ga) * _act(a0, ua)
                h1 = _act(b1, ga) * _act(a1, ua)
                h2 = _act(b2, ga) * _act(a2, ua)
                h3 = _act(b3, ga) * _act(a3, ua)
            else:
                if has_bias:
                    a0 += bias[i0]
                    a1 += bias[i1]
                    a2 += bias[i2]
                    a3 += bias[i3]
                h0 = _act(a0, ua)
                h1 = _act(a1, ua)
                h2 = _act(a2, ua)
                h3 = _act(a3, ua)
            if not l0:
                h0 = zero
            if not l1:
                h1 = zero
            if not l2:
                h2 = zero
            if not l3:
                h3 = zero
            if h0 == 0 and h1 == 0 and h2 == 0 and h3 == 0:
                continue  # ReLU-family neurons that came out inactive: skip their down rows
            # --- down rows: acc += h * down_t, 4 neurons interleaved
            at = acc[t]
            for blk in range(nb):
                lo = np.uint64(blk * block)
                hi = np.uint64(min(blk * block + block, d))
                c0 = h0
                c1 = h1
                c2 = h2
                c3 = h3
                if scaled:
                    c0 *= scales[i0, m_dn, blk]
                    c1 *= scales[i1, m_dn, blk]
                    c2 *= scales[i2, m_dn, blk]
                    c3 *= scales[i3, m_dn, blk]
                for j in range(lo, hi):
                    at[j] += (
                        c0 * _f32(w0[j]) + c1 * _f32(w1[j]) + c2 * _f32(w2[j]) + c3 * _f32(w3[j])
                    )


@_jit(parallel=True)
def _sparse_ffn_kernel(x, rows, scales, bias, idx, mask, gated, ga, ua, block, scratch, out):
    """x, out ``[T, d]``; scratch ``[n_chunks, T, d]``: one chunk of the active list per thread;
    mask ``[T, len(idx)]`` uint8, or 0 rows (``_walk``).

    The loop bodies live in ``_walk``: numba does not apply fastmath inside a prange body.
    Returns the position in idx of the first out-of-range index (then nothing is computed), or -1.
    """
    nc = scratch.shape[0]
    k = idx.shape[0]
    n = rows.shape[0]
    for c in range(k):
        if idx[c] < 0 or idx[c] >= n:
            return c
    per = ((k + nc - 1) // nc + 3) // 4 * 4  # chunk length, a multiple of 4
    for t in prange(nc):
        acc = scratch[t]
        acc[:, :] = 0.0
        s = t * per
        e = min(k, s + per)
        if s < e:
            _walk(x, rows, scales, bias, idx, mask, s, e, gated, ga, ua, block, acc)
    _sum_first_axis(scratch, out)
    return -1


@_jit()
def _sum_first_axis(scratch, out):
    nc = scratch.shape[0]
    T = scratch.shape[1]
    d = scratch.shape[2]
    for t in range(T):
        o = out[t]
        s0 = scratch[0, t]
        for j in range(d):
            o[j] = s0[j]
        for c in range(1, nc):
            sc = scratch[c, t]
            for j in range(d):
                o[j] += sc[j]


# --------------------------------------------------------------------------- predictor


@_jit()
def _gemv_rows(w, x, start, end, y):
    """y[r] = w[r] · x for r in [start, end), four rows at a time (w float32 or bf16 bits)."""
    d = x.shape[0]
    r = start
    while r + 4 <= end:  # inner loops start at 0, so numba's negative-index wraparound folds away
        w0 = w[r]
        w1 = w[r + 1]
        w2 = w[r + 2]
        w3 = w[r + 3]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for j in range(d):
            xj = x[j]
            s0 += _f32(w0[j]) * xj
            s1 += _f32(w1[j]) * xj
            s2 += _f32(w2[j]) * xj
            s3 += _f32(w3[j]) * xj
        y[r] = s0
        y[r + 1] = s1
        y[r + 2] = s2
        y[r + 3] = s3
        r += 4
    while r < end:
        w0 = w[r]
        s0 = np.float32(0.0)
        for j in range(d):
            s0 += _f32(w0[j]) * x[j]
        y[r] = s0
        r += 1


@_jit(parallel=True)
def _predict_kernel(x, fc1, fc2, thresholds, hidden, logits, counts, out_idx):
    nt = counts.shape[0]
    r = fc1.shape[0]
    n = fc2.shape[0]
    per1 = ((r + nt - 1) // nt + 3) // 4 * 4
    for t in prange(nt):
        s = t * per1
        e = min(r, s + per1)
        if s < e:
            _gemv_rows(fc1, x, s, e, hidden)
            for i in range(s, e):
                hidden[i] = max(hidden[i], np.float32(0.0))
    per2 = ((n + nt - 1) // nt + 3) // 4 * 4
    for t in prange(nt):
        s = t * per2
        e = min(n, s + per2)
        c = 0
        if s < e:
            _gemv_rows(fc2, hidden, s, e, logits)
            for i in range(s, e):
                if logits[i] >= thresholds[i]:
                    out_idx[s + c] = i
                    c += 1
        counts[t] = c
    k = counts[0]
    for t in range(1, nt):
        s = t * per2
        for c in range(counts[t]):
            out_idx[k + c] = out_idx[s + c]
        k += counts[t]
    return k


# --------------------------------------------------------------------------- Python wrappers


class _Views(NamedTuple):
    rows: np.ndarray  # float32 / uint16 (bf16 bits) / int8, [d_ff, n_mats, d_model]
    scales: np.ndarray  # float32 [d_ff, n_mats, nb]; nb = 0 when unscaled
    bias: np.ndarray  # float32 [d_ff] or [0]
    gated: bool
    ga: int
    ua: int
    block: int


def _views(ffn: PackedFFN) -> _Views:
    v = ffn._cache.get("views")
    if v is None:
        if ffn.rows.device.type != "cpu":
            raise ValueError(f"ffn.rows: expected a CPU tensor, got one on {ffn.rows.device}")
        if ffn.gates is not None:  # (they need blocks of 32: in_c)
            raise ValueError("ffn.gates: q4 gate rows apart run in the C kernels only")
        if ffn.dtype == "q4":
            raise ValueError("q4 rows run in the C kernels only (sparseinfer.cpu)")
        if ffn.dtype == "bf16":
            rows = ffn.rows.view(torch.int16).numpy().view(np.uint16)
        else:
            rows = ffn.rows.numpy()
        if ffn.scales is not None:
            scales = ffn.scales.numpy()
        else:
            scales = np.zeros((ffn.d_ff, ffn.n_mats, 0), np.float32)
        bias = ffn.up_bias.numpy() if ffn.up_bias is not None else np.zeros(0, np.float32)
        kind = FFN_KINDS[ffn.kind]
        ga = ACT_CODES[kind.gate_act] if kind.gated else 0
        v = _Views(rows, scales, bias, kind.gated, ga, ACT_CODES[kind.up_act], ffn.block)
        ffn._cache["views"] = v
    return v


_local = threading.local()


def _buffer(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A reusable scratch array of the calling thread (contents undefined).

    One flat buffer per name, grown when a larger shape is asked for, so varying batch sizes
    don't pile up buffers.
    """
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    n = math.prod(shape)
    b = bufs.get(name)
    if b is None or b.shape[0] < n or b.dtype != dtype:
        b = bufs[name] = np.empty(n, dtype)
    return b[:n].reshape(shape)


_threads = numba.config.NUMBA_NUM_THREADS  # = numba.get_num_threads() until set_threads
_counts = threading.local()  # .threads: the count numba has on this thread (use_threads)


def set_threads(n: int) -> None:
    """Threads for the kernels: numba's setting and torch's (for the calling thread; other
    threads take them at their first kernel: ``use_threads``) and the chunk count. More than
    numba's pool (NUMBA_NUM_THREADS, by default the cores) is capped, with a warning."""
    global _threads
    if n < 1:
        raise ValueError(f"threads: expected a positive number, got {n}")
    if n > numba.config.NUMBA_NUM_THREADS:
        log.warning("threads: %d requested, the kernels' pool has %d (NUMBA_NUM_THREADS): "
                    "using %d", n, numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS)
        n = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(n)
    torch.set_num_threads(n)  # after numba's: see use_threads
    _threads = n
    _counts.threads = n


def get_threads() -> int:
    return _threads


def use_threads() -> int:
    """The kernels' thread count, given to the calling thread first. Numba's setting and the
    OpenMP thread count torch's operations use are both the calling thread's own (a server's
    batch loop starts from the defaults: every core), and torch's wheel and numba's ``omp``
    layer share one libgomp, whose count numba's pool sets to every core when it starts: so
    numba's count and then torch's, once per thread (else ``-t 1`` ran torch on two threads)."""
    if getattr(_counts, "threads", 0) != _threads:
        numba.set_num_threads(_threads)
        torch.set_num_threads(_threads)
        _counts.threads = _threads
    return _threads


if (_requested := requested_kernel_threads()) is not None:  # set before this module's import
    set_threads(_requested)


# Below this many bytes of active weights one thread beats waking the others (~2 us).
SERIAL_BYTES = 64 * 1024


class _one_thread:
    """Run a parallel kernel on the calling thread only: a 1-chunk ``prange`` still wakes the
    whole team (2-10 us, more when torch's OpenMP threads are still spinning)."""

    __slots__ = ("nt",)

    def __init__(self, nt: int):
        self.nt = nt

    def __enter__(self):
        if self.nt > 1:
            numba.set_num_threads(1)

    def __exit__(self, *exc):
        if self.nt > 1:
            numba.set_num_threads(self.nt)


def in_c(ffn: PackedFFN) -> bool:
    """Rows the C library's kernels take where it loads: q4, q4i8, and int8 whose blocks and
    rows are multiples of 8 (``cpu.sparse_ffn_i8``; other int8 blocks stay in numba)."""
    return (ffn.dtype in ("q4", "q4i8") or (ffn.dtype == "int8" and ffn.d_model % 8 == 0
                                            and ffn.block % 8 == 0)) and cpu_loads()


def rounds_x(ffn: PackedFFN) -> bool:
    """Rows whose gate/up products the C kernels take with x rounded to int8 per 32: q4 and
    q4i8 rows always, int8 rows whose blocks and width are multiples of 32
    (``cpu.ops.i8_rounds_x``). The reference of such a call is the float FFN on
    ``cpu.reference``'s rounded x."""
    from ..cpu.ops import i8_rounds_x  # (ops loads the C library only when called)

    return ffn.dtype in ("q4", "q4i8") or (ffn.dtype == "int8"
                                           and i8_rounds_x(ffn.block, ffn.d_model))


def _run_c(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """q4, q4i8 or int8 rows (``in_c``): the C kernels (``sparseinfer.cpu.sparse_ffn_q4`` /
    ``sparse_ffn_i8``) on [T, d] x and out (``mask``: each token's own neurons among idx), in
    the C library's thread pool. int8 bundles with their gates apart (``ffn.gates``; q4i8
    bundles too) take the gates from those q4 rows: one token without a mask in two passes over
    the pool (every gate, then the fired neurons' up and down rows: ``sparse_ffn_i8_q4g``,
    measured faster than one pass, benchmarks/gates_apart_int8.py), else in ``sparse_ffn_i8``'s
    one pass; a neuron's gate is the same bits either way."""
    from .. import cpu  # the C library: loaded (or reported missing) on first use

    if ffn.rows.device.type != "cpu":
        raise ValueError(f"ffn.rows: expected a CPU tensor, got one on {ffn.rows.device}")
    kind = FFN_KINDS[ffn.kind]
    ga = ACT_CODES[kind.gate_act] if kind.gated else 0
    if idx.dtype != torch.int32 or not idx.is_contiguous():
        idx = idx.to(torch.int32).contiguous()
    try:
        if ffn.dtype == "q4":
            cpu.sparse_ffn_q4(ffn.rows, kind.gated, idx, x.contiguous(), out, ga,
                              ACT_CODES[kind.up_act], ffn.up_bias, mask)
        elif ffn.gates is not None and mask is None and x.shape[0] == 1:
            cpu.sparse_ffn_i8_q4g(ffn.rows, ffn.scales, ffn.block, ffn.gates, idx, x.contiguous(),
                                  out, ACT_CODES[kind.up_act])
        else:
            cpu.sparse_ffn_i8(ffn.rows, ffn.scales, ffn.block, kind.gated, idx, x.contiguous(),
                              out, ga, ACT_CODES[kind.up_act], ffn.up_bias, rounds_x(ffn), mask,
                              ffn.gates)
    except RuntimeError as e:
        if "out of range" in str(e):
            raise IndexError(f"idx: expected neuron indices in [0, {ffn.d_ff})") from e
        raise
    return out


def _idx_numpy(idx: torch.Tensor) -> np.ndarray:
    """int32 numpy view of idx (int64 is converted: one kernel specialisation, not two)."""
    if idx.dtype == torch.int32 and idx.is_contiguous():
        return idx.numpy()
    return idx.numpy().astype(np.int32)


_NO_MASK = np.zeros((0, 0), dtype=np.uint8)


def _run_ffn(xn: np.ndarray, ffn: PackedFFN, idn: np.ndarray, on: np.ndarray,
             mask: torch.Tensor | None = None) -> None:
    """xn, on: [T, d] float32 numpy; idn int32; mask: bool or uint8 [T, len(idn)], or None."""
    v = _views(ffn)
    T = xn.shape[0]
    mk = _NO_MASK
    if mask is not None:
        if mask.dtype not in (torch.bool, torch.uint8) or tuple(mask.shape) != (T, idn.shape[0]):
            raise ValueError(f"mask: expected bool or uint8 [{T}, {idn.shape[0]}], got "
                             f"{mask.dtype} {list(mask.shape)}")
        mk = mask.contiguous().view(torch.uint8).numpy()
    nt = use_threads()  # (numba.get_num_threads() costs ~0.7 us)
    if nt > 1 and T * idn.shape[0] * ffn.bytes_per_neuron >= SERIAL_BYTES:
        scratch = _buffer("acc", (nt, T, ffn.d_model), np.float32)
        bad = _sparse_ffn_kernel(
            xn, v.rows, v.scales, v.bias, idn, mk, v.gated, v.ga, v.ua, v.block, scratch, on
        )
    else:
        scratch = on.reshape(1, T, ffn.d_model)  # one chunk: accumulate straight into out
        with _one_thread(nt):
            bad = _sparse_ffn_kernel(
                xn, v.rows, v.scales, v.bias, idn, mk, v.gated, v.ga, v.ua, v.block, scratch, on
            )
    if bad != -1:
        raise IndexError(f"idx: expected neuron indices in [0, {ffn.d_ff}), found {idn[bad]}")


def sparse_ffn(
    x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out[:] = sum_{i in idx} h_i(x) * down_t[i]`` (see ``reference.sparse_ffn_ref``).

    x, out: ``[d_model]`` float32 (out overwritten); idx: int32 (fast) or int64 ``[k]``, unique.
    """
    check_ffn_args(x, ffn, idx, out)
    if idx.shape[0] == 0:
        return out.zero_()
    if in_c(ffn):
        _run_c(x.reshape(1, -1), ffn, idx, out.view(1, -1))
        return out
    xn = x.numpy() if x.is_contiguous() else x.contiguous().numpy()
    _run_ffn(xn.reshape(1, -1), ffn, _idx_numpy(idx), out.numpy().reshape(1, -1))
    return out


def sparse_ffn_batch(
    x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, out: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched ``sparse_ffn``: x, out ``[T, d_model]``, one (union) active set for all T tokens.

    Each group of 4 neurons is read from memory once and reused from cache for every token, so
    it pays off while the union stays small; over fp32 rows torch's dense FFN catches up at a
    few hundred tokens, over int8 rows it did not by 256 (benchmarks/prefill.py). ``mask``
    (bool or uint8 [T, len(idx)]): token t computes only the neurons ``idx[i]`` with
    ``mask[t, i]``, its own set (the union's bundles still read once); a place masked for every
    token is never computed, so any row may stand there, and the list may be longer than
    ``ffn.d_ff`` (the disk tier's gates first keeps the all-in-RAM call's list). The C kernels
    give a token's row the bits of its call alone; numba's sums its own set in the union's
    groups of 4, so its row is the lone call's to float rounding.
    """
    check_batch_args(x, ffn, idx, out, mask is not None)
    if in_c(ffn):
        return _run_c(x, ffn, idx, out, mask)
    xn = x.numpy() if x.is_contiguous() else x.contiguous().numpy()
    _run_ffn(xn, ffn, _idx_numpy(idx), out.numpy(), mask)
    return out


def gate_dots(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw gate dot products ``z[i] = gate_{idx[i]} · x`` of a gated q4 FFN for one token
    (x float32 ``[d_model]``; idx int32 or int64 ``[k]``; out float32 ``[k]``, allocated if None),
    by the C kernel's own arithmetic (``cpu.sparse_q4_gates``): with a ReLU gate (ReGLU, dReLU)
    ``z > 0`` is exactly where ``sparse_ffn`` / ``sparse_ffn_batch`` find the gate fired, and
    ``relu(z)`` is the gate they use, whatever other neurons the call holds. So a call over
    ``idx`` equals one over the same ``idx`` with ``mask = z > 0`` (``sparse_ffn_batch``, T = 1)
    bit for bit: a neuron not fired adds nothing, and its up and down rows are not read, either
    way (the masked call reads not even its gate row: any valid row may stand at its place). A
    shorter list of the fired neurons alone gives the same bits only while both calls are one
    chunk of the pool (up to 32 neurons): beyond, the pool's neuron ranges, and with them the
    partial sums, are cut elsewhere in the list."""
    if ffn.dtype != "q4" or not FFN_KINDS[ffn.kind].gated:
        raise ValueError(f"ffn: expected a gated FFN of q4 rows, got {ffn.kind} {ffn.dtype}")
    if ffn.rows.device.type != "cpu":
        raise ValueError(f"ffn.rows: expected a CPU tensor, got one on {ffn.rows.device}")
    d = ffn.d_model
    if x.dtype != torch.float32 or x.shape != (d,):
        raise ValueError(f"x: expected float32 [{d}], got {x.dtype} {list(x.shape)}")
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: expected int32/int64 [k], got {idx.dtype} {list(idx.shape)}")
    if idx.dtype != torch.int32 or not idx.is_contiguous():
        idx = idx.to(torch.int32).contiguous()
    from .. import cpu  # the C library: loaded (or reported missing) on first use

    try:
        return cpu.sparse_q4_gates(ffn.rows, idx, x.contiguous(), out)
    except RuntimeError as e:
        if "out of range" in str(e):
            raise IndexError(f"idx: expected neuron indices in [0, {ffn.d_ff})") from e
        raise


def _np_weights(t: torch.Tensor) -> np.ndarray:
    """float32 as is; bfloat16 as its uint16 bits (the kernels widen them with ``_f32``)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def predict_active(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float, out_idx: torch.Tensor,
    *, neuron_thresholds: torch.Tensor | None = None,
) -> int:
    """Neurons with predictor logit ``fc2 @ relu(fc1 @ x) >= threshold``, ascending, into
    ``out_idx[:k]``; returns k (see ``reference.predict_active_ref``). ``fc1``/``fc2`` are
    float32 or bfloat16 (half the bytes; products accumulate in float32). ``neuron_thresholds``
    (float32 [d_ff]) replaces the scalar threshold per neuron: a predictor bias b folds in as
    ``threshold - b``."""
    check_predict_args(x, fc1, fc2, out_idx)
    if neuron_thresholds is None:
        thr = _buffer("thresholds", (fc2.shape[0],), np.float32)
        thr.fill(np.float32(threshold))
    else:
        if neuron_thresholds.dtype != torch.float32 or neuron_thresholds.shape != (fc2.shape[0],):
            raise ValueError(f"neuron_thresholds: expected float32 [{fc2.shape[0]}], got "
                             f"{neuron_thresholds.dtype} {list(neuron_thresholds.shape)}")
        thr = neuron_thresholds.numpy()
    nt = use_threads()
    if (fc1.numel() + fc2.numel()) * fc1.element_size() < SERIAL_BYTES:
        nt = 1
    hidden = _buffer("hidden", (fc1.shape[0],), np.float32)
    logits = _buffer("logits", (fc2.shape[0],), np.float32)
    counts = _buffer("counts", (nt,), np.int64)
    xn = x.numpy() if x.is_contiguous() else x.contiguous().numpy()
    args = (xn, _np_weights(fc1), _np_weights(fc2), thr, hidden, logits, counts)
    with _one_thread(_threads if nt == 1 else 1):
        k = _predict_kernel(*args, out_idx.numpy())
    return int(k)


def sparse_ffn_predicted(
    x: torch.Tensor,
    ffn: PackedFFN,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    threshold: float,
    out_idx: torch.Tensor,
    out: torch.Tensor,
) -> int:
    """``predict_active`` then ``sparse_ffn`` on its active set; returns k (``out_idx[:k]``)."""
    k = predict_active(x, fc1, fc2, threshold, out_idx)
    sparse_ffn(x, ffn, out_idx[:k], out)
    return k


# --------------------------------------------------------------------------- dense baseline


class DenseFFN(NamedTuple):
    """Dense copy of a layer for torch's matmuls (the baseline): gate and up fused."""

    kind: str
    d_ff: int
    gate_up: torch.Tensor  # [(n_mats - 1) * d_ff, d_model]: gate rows then up rows
    down: torch.Tensor  # [d_model, d_ff] (nn.Linear layout)
    gate_up_scales: torch.Tensor | None  # int8: per output row
    down_scales: torch.Tensor | None
    up_bias: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self[2:] if t is not None)

    def clone(self) -> DenseFFN:
        return DenseFFN(self.kind, self.d_ff, *(None if t is None else t.clone() for t in self[2:]))


def dense_weights(ffn: PackedFFN, weights: str = "fp32") -> DenseFFN:
    """The dense copy of ``ffn`` (built once, cached on it: a second copy of the layer).

    ``weights="fp32"``: dequantized fp32. ``weights="stored"``: the storage dtype for torch's own
    path: fp32, bf16, or int8 with per-row scales for ``torch._weight_int8pack_mm`` (int8 per-row
    packs only; the down matrix is requantized per row of its nn.Linear layout, so it is close to
    but not bit-equal with the packed weights).
    """
    if weights not in ("fp32", "stored"):
        raise ValueError(f"weights: expected 'fp32' or 'stored', got {weights!r}")
    key = f"dense_{weights}"
    w = ffn._cache.get(key)
    if w is not None:
        return w
    gate, up, down = ffn.dequantized()
    gu = torch.cat([gate, up]) if gate is not None else up
    s_gu = s_dn = None
    if weights == "stored" and ffn.dtype == "bf16":
        gu, down = gu.to(torch.bfloat16), down.to(torch.bfloat16)
    elif weights == "stored" and ffn.dtype == "int8":
        if ffn.block != ffn.d_model:
            raise ValueError(
                f"weights='stored': torch's int8 matmul needs per-row scales "
                f"(block={ffn.d_model}), got block={ffn.block}; use weights='fp32'"
            )
        n = ffn.n_mats
        gu = ffn.rows[:, : n - 1].transpose(0, 1).reshape(-1, ffn.d_model).contiguous()
        s_gu = ffn.scales[:, : n - 1, 0].t().reshape(-1).contiguous()
        down, s_dn = quantize_int8(down, down.shape[1])
        s_dn = s_dn.reshape(-1).contiguous()
    w = DenseFFN(ffn.kind, ffn.d_ff, gu, down, s_gu, s_dn, ffn.up_bias)
    ffn._cache[key] = w
    return w


def dense_ffn(x: torch.Tensor, dense: DenseFFN, out: torch.Tensor) -> torch.Tensor:
    """All neurons of ``dense`` with torch matmuls; out ``[d_model]`` is overwritten."""
    kind = FFN_KINDS[dense.kind]
    if dense.gate_up_scales is not None:
        z = torch._weight_int8pack_mm(x.unsqueeze(0), dense.gate_up, dense.gate_up_scales)[0]
    else:
        z = F.linear(x.to(dense.gate_up.dtype), dense.gate_up).float()
    if dense.up_bias is not None:
        z = z + dense.up_bias
    if kind.gated:
        h = ACTS[kind.gate_act](z[: dense.d_ff]) * ACTS[kind.up_act](z[dense.d_ff :])
    else:
        h = ACTS[kind.up_act](z)
    if dense.down_scales is not None:
        out.copy_(torch._weight_int8pack_mm(h.unsqueeze(0), dense.down, dense.down_scales)[0])
    else:
        out.copy_(F.linear(h.to(dense.down.dtype), dense.down))
    return out


def dense_ffn_ref(
    x: torch.Tensor, ffn: PackedFFN, out: torch.Tensor, *, weights: str = "fp32"
) -> torch.Tensor:
    """All neurons with torch matmuls on ``dense_weights(ffn, weights)``: the dense baseline."""
    return dense_ffn(x, dense_weights(ffn, weights), out)


def warmup() -> None:
    """Compile (or load from numba's cache) the kernels for every storage dtype."""
    for dtype in ("fp32", "bf16", "int8"):
        ffn = PackedFFN.from_dense("relu", None, torch.zeros(4, 8), torch.zeros(8, 4), dtype=dtype)
        sparse_ffn(torch.zeros(8), ffn, torch.arange(4, dtype=torch.int32), torch.zeros(8))
    out_idx = torch.zeros(4, dtype=torch.int32)
    predict_active(torch.zeros(8), torch.zeros(4, 8), torch.zeros(4, 4), 0.0, out_idx)


# --------------------------------------------------------------------------- dense GEMV


@_jit(parallel=True)
def _gemv_kernel(w, x, n_chunks, y):
    n = w.shape[0]
    per = ((n + n_chunks - 1) // n_chunks + 3) // 4 * 4
    for c in prange(n_chunks):
        _gemv_rows(w, x, min(c * per, n), min((c + 1) * per, n), y)


def gemv(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = w @ x`` for fp32 ``w`` [n, d] (contiguous) and ``x`` [d]: one streaming pass over
    the rows, four at a time, split across the kernel threads (reference: ``torch.mv``)."""
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"w: expected contiguous float32 [n, d], got {w.dtype} {list(w.shape)}")
    if x.dtype != torch.float32 or x.shape != (w.shape[1],):
        raise ValueError(f"x: expected float32 [{w.shape[1]}], got {x.dtype} {list(x.shape)}")
    if out.dtype != torch.float32 or out.shape != (w.shape[0],) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous float32 [{w.shape[0]}], got {list(out.shape)}")
    xn = x.numpy() if x.is_contiguous() else x.contiguous().numpy()
    _gemv_kernel(w.numpy(), xn, use_threads() * 4, out.numpy())
    return out
