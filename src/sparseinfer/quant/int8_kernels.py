"""numba kernels of ``quant.linear``'s int8 products (``gemv_int8``, ``gemm_int8_rows``): a module
of their own so that numba is imported only when one of them is first used (start-up time)."""

from __future__ import annotations

import numpy as np
from numba import prange

from ..sparse.kernels import _jit


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
def int8_gemv_kernel(q, scale, x, n_chunks, y):  # pragma: no cover - compiled
    n = q.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _int8_rows(q, scale, x, min(c * per, n), min((c + 1) * per, n), y)


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
def int8_gemm_kernel(q, scale, x, n_chunks, y):  # pragma: no cover - compiled
    n = q.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _int8_rows_batch(q, scale, x, min(c * per, n), min((c + 1) * per, n), y)
