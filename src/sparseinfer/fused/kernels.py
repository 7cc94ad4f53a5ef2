"""numba kernels of ``fused.decode`` (``rms_norm``, ``attend``): a module of their own so that
numba is imported only when the numba path first runs (the C block does the default model's
work; start-up time)."""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True, fastmath=False, nogil=True)
def rms_norm_kernel(x, add, w, eps, out):  # pragma: no cover - compiled
    d = x.shape[0]
    if add.shape[0] == d:
        for i in range(d):
            x[i] += add[i]
    ss = 0.0
    for i in range(d):
        ss += x[i] * x[i]
    r = np.float32(1.0 / math.sqrt(ss / d + eps))
    for i in range(d):
        out[i] = x[i] * r * w[i]


@numba.njit(cache=True, fastmath=True, nogil=True)
def attend_kernel(qkv, kc, vc, pos, cos, sin, nh, nkv, scale, scores, out,
            interleaved=False):  # pragma: no cover
    hd = kc.shape[2]
    half = hd // 2
    group = nh // nkv
    ko = nh * hd
    vo = ko + nkv * hd
    # rope on every q and k head (rotate-half or interleaved pairs), in place in qkv; k/v into
    # the cache
    for h in range(nh + nkv):
        base = h * hd
        for j in range(half):
            if interleaved:
                i0, i1 = base + 2 * j, base + 2 * j + 1
            else:
                i0, i1 = base + j, base + half + j
            a, b = qkv[i0], qkv[i1]
            qkv[i0] = a * cos[j] - b * sin[j]
            qkv[i1] = b * cos[half + j] + a * sin[half + j]
    for g in range(nkv):
        for j in range(hd):
            kc[g, pos, j] = qkv[ko + g * hd + j]
            vc[g, pos, j] = qkv[vo + g * hd + j]
    n = pos + 1
    for h in range(nh):
        g = h // group
        q = qkv[h * hd:(h + 1) * hd]
        m = -np.inf
        for s in range(n):
            acc = np.float32(0.0)
            for j in range(hd):
                acc += q[j] * kc[g, s, j]
            acc *= scale
            scores[s] = acc
            if acc > m:
                m = acc
        tot = np.float32(0.0)
        for s in range(n):
            e = np.float32(math.exp(scores[s] - m))
            scores[s] = e
            tot += e
        o = out[h * hd:(h + 1) * hd]
        for j in range(hd):
            o[j] = 0.0
        for s in range(n):
            p = scores[s] / tot
            for j in range(hd):
                o[j] += p * vc[g, s, j]


# ---- torch references ---------------------------------------------------------------------------
