"""4-bit weights from the file's blocks into the layout of torch's CPU int4 kernel, in numba.

``nibbles``: a Q4_0 / Q4_1 tensor's blocks as uint8 nibbles and float16 scales (and minima) in
one pass (numpy's masks, shifts and concatenation took most of a 7B load without the C library).

``torch._convert_weight_to_int4pack_for_cpu`` takes the nibbles as an int32 ``[N, K]`` matrix:
four bytes a weight made from our uint8 nibbles and written once more, then read a column at a
time — on a 7B Q4_0 file most of the load without the C library (benchmarks/RESULTS.md). Its
output puts the rows of each block of ``BLOCK_N`` rows (float vector width x 4, set by the CPU
capability torch runs at) two to a byte, column by column: with 64 rows (AVX-512) byte ``d`` of
a column holds rows ``d`` and ``d + 32``, byte ``16 + d`` rows ``d + 16`` and ``d + 48``; with 32
(AVX2) byte ``d`` rows ``d`` and ``d + 16``; a short last block, and every block of the plain
build, neighbouring rows ``n`` and ``n + 1``. ``pack`` writes that straight from the uint8
nibbles. Which of those layouts this torch uses is not read from its build
but found once by packing a small probe both ways; if none agrees, torch's own conversion runs
(``pack_ref``), so a torch with another layout is slower to load, never wrong.

Both kernels run on numba's threads, one call at a time (``_ONE_CALL``): a load calls them from
its own threads, one module each (``models/build.py``), and numba's workqueue layer (the one it
falls back to without OpenMP or TBB) aborts when a parallel kernel is entered from two threads.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import torch
from numba import prange

from ..sparse.kernels import _jit, use_threads

log = logging.getLogger(__name__)
_ONE_CALL = threading.Lock()

# (kind, rows per block): kind 1 the 64-row interleave, 2 the 32-row one, 0 neighbouring rows
LAYOUTS = ((1, 64), (2, 32), (0, 64), (0, 32), (0, 16))


@_jit(parallel=True)
def _pack(q, out, kind, block_n):  # pragma: no cover - compiled
    """Row by row of a block (each read once, in order), its nibbles to their column's byte."""
    n, k = q.shape
    for i in prange((n + block_n - 1) // block_n):
        r0 = i * block_n
        nb = min(block_n, n - r0)
        base = r0 * (k // 2)
        if nb == 64 and kind == 1:
            for d in range(16):
                lo0, hi0, lo1, hi1 = q[r0 + d], q[r0 + d + 32], q[r0 + d + 16], q[r0 + d + 48]
                for c in range(k):
                    out[base + c * 32 + d] = lo0[c] | (hi0[c] << 4)
                    out[base + c * 32 + 16 + d] = lo1[c] | (hi1[c] << 4)
        elif nb == 32 and kind == 2:
            for d in range(16):
                lo, hi = q[r0 + d], q[r0 + d + 16]
                for c in range(k):
                    out[base + c * 16 + d] = lo[c] | (hi[c] << 4)
        else:
            half = nb // 2
            for j in range(half):
                lo, hi = q[r0 + 2 * j], q[r0 + 2 * j + 1]
                for c in range(k):
                    out[base + c * half + j] = lo[c] | (hi[c] << 4)


@_jit(parallel=True)
def _nibbles(blocks, qoff, q, d, m):  # pragma: no cover - compiled
    n, nb = blocks.shape[0], blocks.shape[1]
    for r in prange(n):
        for b in range(nb):
            blk = blocks[r, b]
            d[r, b] = blk[0] | (np.uint16(blk[1]) << 8)
            if qoff == 4:
                m[r, b] = blk[2] | (np.uint16(blk[3]) << 8)
            o = 32 * b
            for j in range(16):
                v = blk[qoff + j]
                q[r, o + j] = v & 15
                q[r, o + 16 + j] = v >> 4


def nibbles(blocks: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q4_0 (``with_min`` False: 18 bytes) or Q4_1 (True: 20 bytes) blocks ``[n, nb, size]``
    as (nibbles uint8 ``[n, 32 nb]``: a block's low nibbles, then its high ones; d float16
    ``[n, nb]``; m float16 or None), as llama.cpp lays a block out."""
    n, nb, size = blocks.shape
    if size != (20 if with_min else 18):
        raise ValueError(f"blocks: expected {20 if with_min else 18} bytes each, got {size}")
    q = np.empty((n, 32 * nb), dtype=np.uint8)
    d = np.empty((n, nb), dtype=np.uint16)
    m = np.empty((n, nb) if with_min else (0, 0), dtype=np.uint16)  # (Q4_0: no minima, unused)
    blocks = np.ascontiguousarray(blocks)
    with _ONE_CALL:
        use_threads()
        _nibbles(blocks, 4 if with_min else 2, q, d, m)
    return q, d.view(np.float16), m.view(np.float16) if with_min else None


def pack_ref(q: torch.Tensor) -> torch.Tensor:
    """torch's own conversion of nibbles ``q`` (uint8 ``[N, K]``, 0..15)."""
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def _pack_as(q: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    q = q.contiguous()
    with _ONE_CALL:
        use_threads()
        _pack(q.numpy(), out.view(-1).numpy(), *layout)
    return out


@functools.lru_cache(maxsize=None)
def layout() -> tuple[int, int] | None:
    """The layout of ``LAYOUTS`` this torch's conversion writes (None: none of them), from a
    probe of 176 x 64 nibbles (two blocks of 64 rows and a short one of 48; five of 32 and one
    of 16)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (176, 64), dtype=torch.uint8, generator=g)
    want = pack_ref(q)
    for lay in LAYOUTS:
        if torch.equal(_pack_as(q, lay), want):
            return lay
    log.info("torch %s packs int4 weights in a layout not known here: its own conversion is "
             "used (slower loads)", torch.__version__)
    return None


def pack(q: torch.Tensor) -> torch.Tensor:
    """``pack_ref(q)``'s bytes (uint8 ``[N, K // 2]``) from nibbles ``q`` (uint8 ``[N, K]``,
    0..15), without the int32 copy (rows other than a multiple of 16, which torch's kernel
    does not multiply by, go through ``pack_ref``)."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q: expected uint8 [N, K] nibbles with K even, got {q.dtype} "
                         f"{list(q.shape)}")
    lay = layout()
    return pack_ref(q) if lay is None or q.shape[0] % 16 else _pack_as(q, lay)
