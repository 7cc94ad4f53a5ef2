"""Quantized GEMV/GEMM over GGUF's own blocks, in a small C library (``libsicpu.so``).

The weights are the tensor's bytes as the GGUF file stores them (row-major rows of blocks; e.g.
``gguf.GGUFReader`` tensor ``t.data`` viewed as uint8, a read-only memmap: not copied). Types:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16 and F32, and Q4_0x16 ... Q5_1x16: Q4_0 /
Q4_1 / Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K / Q5_1 rearranged in panels of 16 rows (Q6_K and Q5_K
also as Q6_Kx16b / Q5_Kx16b, their weights byte-aligned: ``panels.panel_type`` picks by ISA)
(``panels.to_panels``;
the loader does it for every such matrix whose rows are a multiple of 16: a GEMM over a few
rows of x then takes a third to half of the instructions, and the GEMV is as fast or faster).
The input vector is quantized once per call to int8 blocks of 32 (scale ``max|x|/127``, as
llama.cpp's q8_0) and each block of weights is an integer dot product with it (F16 and F32 use fp32 ``x`` as is).

    from sparseinfer import cpu
    wq = cpu.QuantMatrix("Q4_K", raw, rows, cols)         # raw: uint8 bytes, not copied
    wp = cpu.QuantMatrix("Q4_1x16", panels.to_panels(raw1, "Q4_1", rows, cols), rows, cols)
    cpu.gemv([wq, wk, wv], x, [q, k, v])                 # x quantized once, one pool dispatch
    plan = cpu.GemvPlan([wg, wu], [g, u]); plan(x)        # the same with per-call work hoisted
    y = cpu.gemm(wq, X)                                  # X [T, cols] -> [T, rows]
    cpu.gemm_each([w1, w2], X, [3, 5], [Y1, Y2])         # matrix i against its own next rows of X
    cpu.GemvPlan([w1, w2], [y1, y2], each=True)(X2)      # ... against its own row X2[i]
    cpu.sparse_ffn_q4(rows, gated, idx, X, out, ga, ua)   # sparse FFN over Q4_0 neuron bundles
    z = cpu.sparse_q4_gates(rows, idx, x)                # ... their raw gate dot products alone
    cpu.sparse_ffn_i8(rows8, scales, 32, gated, idx, X, out, ga, ua)  # ... over int8 bundles
    cpu.sparse_ffn_i8_q4g(rows8, scales, 32, gates, idx, x1, out1, ua)  # ... their gates as q4
    cpu.sparse_ffn_i8_q4g(q4i8, None, 32, gates, idx, x1, out1, ua)  # ... and their ups as q4
    k = cpu.predict_f16(cpu.F16Predictor(fc1, fc2, thr), x, idx)  # a predictor's active set
    vals, ids = cpu.topk(logits, 40)                      # torch.topk of a float32 vector
    i = cpu.sample_topk(logits, 40, 0.95, 0.05, 0.8, u)   # top-k/p, min-p, temperature, draw u
    blk = cpu.DecodeBlock(d_model=..., qkv=[wq, wk, wv], wo=[wo], w_in=[wg, wu], down=[wd], ...)
    blk(x, pos, k_cache, v_cache, cos, sin)              # one token through a whole llama block
    blk.rows(X, positions, slots, k_caches, v_caches, cos_table, sin_table)  # one per sequence
    cpu.DecodeStack([blk0, blk1, ...])(X, positions, slots, k, v, ropes)  # every block, one call
    cpu.read_runs(fd, start, length, first, pick, dest, stride, out, 512, 8, False)  # disk reads
    cpu.read_gather(rows, stride, nbytes, idx)           # a read probe: the sparse kernels' pattern

Variants: AVX2+FMA; the same with AVX-VNNI's byte dot products (``"avx2_vnni"``, CPUs with
AVX-VNNI and no AVX-512: Intel from Alder Lake); the same in 128-bit registers (``"avx2_128"``,
for CPUs whose vector units split 256-bit instructions: AMD Zen and Zen+); and AVX-512
(F/BW/VL) with VNNI. ``best_isa()``
is chosen at import; ``set_isa(name)`` forces another. Threads: a persistent pool inside the library
(``set_threads``, 1 until set); idle workers spin briefly (``set_spin_us``) and then sleep;
``pool_stats`` counts the chunks the caller and the workers ran; ``set_block_timing(True)`` makes
the decode blocks sum their wall time per phase (``BLOCK_PHASES``: QKV, attention, output
projection, predictor, gates, FFN, rest), which ``block_times()`` reads. A call's rows are split in
contiguous chunks (about 8 per thread, at least 32 KiB of weights each), claimed one at a time;
a sparse FFN call's neurons in one range per thread (at least 32 neurons each).

The library is built by ``python3 -m sparseinfer.cpu.build`` (``./install.sh`` does it). The
first use of any name below imports ``sparseinfer.cpu.ops``, which loads it: missing, or built
from other sources, it raises ``CpuLibraryError`` saying to run ``./install.sh`` (importing this
package itself never fails, so the build command can run).
References with the same signatures are in ``reference.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "TYPES",
    "CpuLibraryError",
    "DecodeBlock",
    "DecodeStack",
    "GemvPlan",
    "QuantMatrix",
    "available_isas",
    "best_isa",
    "gemm",
    "gemv",
    "gemm_each",
    "get_isa",
    "get_threads",
    "quantize_x",
    "quantize_xk",
    "set_isa",
    "set_spin_us",
    "set_threads",
    "sparse_ffn_q4",
    "sparse_q4_gates",
    "sparse_ffn_i8",
    "sparse_ffn_i8_q4g",
    "read_gather",
    "F16Predictor",
    "SparseBlockFFN",
    "attend_token",
    "attend_token_raw",
    "attend_rows_raw",
    "predict_f16",
    "predict_f16_mask",
    "pool_stats",
    "BLOCK_PHASES",
    "set_block_timing",
    "block_times",
    "topk",
    "sample_topk",
    "bundle_rows",
    "read_runs",
]

if TYPE_CHECKING:
    from .ops import *  # noqa: F403


_LOADS: bool | None = None
_WHY_NOT = ""  # why the library did not load


def loads() -> bool:
    """Whether the C library loads here: built from these sources, on a CPU with AVX2+FMA or
    AVX-512, and not switched off (``SPARSEINFER_C_KERNELS=0``). Where it does not, models run
    on torch's kernels and numba's (slower; the first call logs why, once)."""
    global _LOADS, _WHY_NOT
    if _LOADS is None:
        from ..errors import SparseInferError

        try:
            from . import ops  # noqa: F401
            _LOADS = True
        except SparseInferError as e:
            import logging

            _WHY_NOT = str(e)
            logging.getLogger(__name__).warning("%s; running on torch's kernels instead", e)
            _LOADS = False
    return _LOADS


def kernels_in_use() -> str:
    """One line for ``info``: the C kernels' variant in use, or why they are not in use."""
    if loads():
        from . import ops

        return f"the C library's, {ops.get_isa()} (this CPU takes {', '.join(ops.available_isas())})"
    return f"torch's and numba's, not the C library's: {_WHY_NOT}"


def __getattr__(name: str):
    # Loaded on first use, not at package import: `python3 -m sparseinfer.cpu.build` must run
    # while the library is missing or stale.
    if name in __all__:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
