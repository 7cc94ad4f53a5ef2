"""The ctypes wrapper of the C kernel library (``libsicpu.so``); its public names are re-exported
by ``sparseinfer.cpu`` (see the package docstring). Importing this module loads the library and
raises ``CpuLibraryError`` if it is missing or was built from other sources.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SparseInferError
from . import build as _build
from .panels import FILE_TYPES, PANEL, check_panel_shape, from_panels

log = logging.getLogger(__name__)

__all__ = [
    "TYPES",
    "CpuLibraryError",
    "DecodeBlock",
    "DecodeStack",
    "SparseBlockFFN",
    "GemvPlan",
    "QuantMatrix",
    "available_isas",
    "best_isa",
    "gemm",
    "gemv",
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
    "F16Predictor",
    "attend_token",
    "attend_token_raw",
    "predict_f16",
    "pool_stats",
    "BLOCK_PHASES",
    "set_block_timing",
    "block_times",
    "topk",
]

# GGUF type name -> library type code (enum si_type in qgemv.h), block elements, block bytes.
TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (0, 32, 18),
    "Q4_1": (1, 32, 20),
    "Q5_0": (2, 32, 22),
    "Q5_1": (3, 32, 24),
    "Q8_0": (4, 32, 34),
    "Q4_K": (5, 256, 144),
    "Q5_K": (6, 256, 176),
    "Q6_K": (7, 256, 210),
    "F16": (8, 1, 2),
    "F32": (9, 1, 4),
    # Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K / Q5_1 in panels of 16 rows
    # (cpu/panels.py): the same bytes, rearranged
    "Q4_0x16": (10, 32, 18),
    "Q4_1x16": (11, 32, 20),
    "Q8_0x16": (12, 32, 34),
    "Q5_0x16": (13, 32, 22),
    "Q4_Kx16": (14, 256, 144),
    "Q5_Kx16": (15, 256, 176),
    "Q6_Kx16": (16, 256, 210),
    "Q5_1x16": (17, 32, 24),
    "Q6_Kx16b": (18, 256, 210),  # Q6_K panels, six-bit weights byte-aligned
    "Q5_Kx16b": (19, 256, 176),  # Q5_K panels, five-bit weights byte-aligned
    "BF16": (20, 1, 2),  # bfloat16 rows
}
ISAS = {"avx2": 0, "avx512": 1, "avx2_128": 2, "avx2_vnni": 3}
ABI_VERSION = 30
# ``SPARSEINFER_C_KERNELS=0`` in the environment: run as where the library cannot load (another
# CPU architecture, an x86 CPU without AVX2): torch's kernels, the numba decode
OFF_SWITCH = "SPARSEINFER_C_KERNELS"


class CpuLibraryError(SparseInferError):
    """The C kernel library is missing, stale or unusable on this machine."""


def _load() -> ctypes.CDLL:
    if os.environ.get(OFF_SWITCH, "").strip() == "0":
        raise CpuLibraryError(f"the C kernels are switched off ({OFF_SWITCH}=0)")
    other = _build.other_machine()
    if other:
        raise CpuLibraryError(other)
    fix = f"run ./install.sh (or `{_build.BUILD_COMMAND}`) to build it"
    if not _build.LIB.exists():
        raise CpuLibraryError(f"the C kernel library {_build.LIB} is not built: {fix}")
    try:
        lib = ctypes.CDLL(str(_build.LIB))
    except OSError as e:
        raise CpuLibraryError(f"cannot load {_build.LIB} ({e}): {fix}") from e
    lib.si_source_hash.restype = ctypes.c_char_p
    built, want = lib.si_source_hash().decode(), _build.source_hash()
    if built != want or lib.si_abi_version() != ABI_VERSION:
        raise CpuLibraryError(f"{_build.LIB} is stale: built from sources {built}, expected {want}"
                              f": {fix}")
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.si_gemv.argtypes = [ci, vp, vp, vp, ci, vp, vp]
    lib.si_gemv_each.argtypes = [ci, vp, vp, vp, ci, vp, vp]
    lib.si_gemm_each.argtypes = [ci, vp, vp, vp, ci, vp, vp, vp]
    lib.si_gemm.argtypes = [ci, vp, i64, ci, vp, i64, vp]
    lib.si_quantize_x.argtypes = [vp, ci, vp, vp, vp]
    lib.si_quantize_xk.argtypes = [vp, ci, vp, vp, vp, vp]
    lib.si_sparse_q4.argtypes = [vp, ctypes.c_size_t, ci, vp, ci, vp, ci, vp, ci, ci, ci, ci, vp,
                                 vp]
    lib.si_sparse_q4_gates.argtypes = [vp, ctypes.c_size_t, vp, ci, ci, vp, ci, vp]
    lib.si_sparse_i8.argtypes = [vp, vp, ci, ci, ci, vp, ci, vp, ci, vp, ci, ci, ci, ci, ci, vp,
                                 vp, vp, ctypes.c_size_t, ci]
    lib.si_sparse_i8_q4g.argtypes = [vp, vp, ci, ci, vp, ctypes.c_size_t, vp, ci, ci, vp, ci, ci,
                                     ci, vp, ci]
    lib.si_predict_f16.argtypes = [vp, vp, ci, ci, ci, vp, vp, vp, vp, vp, vp]
    lib.si_set_block_timing.argtypes = [ci]
    lib.si_block_times.argtypes = [vp, ci, ci]
    lib.si_predict_f16_rows.argtypes = [vp, vp, ci, ci, ci, vp, ci, vp, vp, vp, vp]
    lib.si_topk.argtypes = [vp, i64, ci, vp, vp]
    dbl = ctypes.c_double
    lib.si_sample.argtypes = [vp, i64, ci, dbl, dbl, dbl, dbl, vp]
    lib.si_to_panels.argtypes = [ci, vp, i64, ci, vp]
    lib.si_bundle_rows.argtypes = [ci, vp, i64, i64, ci, ci, vp, i64, vp, i64]
    lib.si_read_runs.argtypes = [ci, ci, vp, vp, vp, vp, vp, i64, i64, vp, ci, ci, ci, vp, vp]
    sz = ctypes.c_size_t
    lib.si_read_gather.argtypes = [vp, sz, sz, sz, vp, ci, ctypes.POINTER(ctypes.c_uint64)]
    if lib.si_get_isa() < 0:
        raise CpuLibraryError("this CPU has neither AVX2+FMA nor AVX-512: the C kernels need one")
    return lib


_lib = _load()
_gemv = _lib.si_gemv
# The sampler's call (tens of microseconds) keeps the GIL: a ctypes call that releases it lets
# any other Python thread in (a server's request threads, its event loop) and waits for that
# thread's whole turn before it can return, once per sampled token (benchmarks/RESULTS.md).
_held = ctypes.PyDLL(str(_build.LIB)).si_sample
_held.argtypes = _lib.si_sample.argtypes
_ERRORS = {22: "invalid argument", 12: "out of memory", 19: "no instruction set selected",
           34: "a neuron index out of range", 38: "this CPU lacks AVX2 or F16C"}


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed in the C library: {_ERRORS.get(rc, f'error {rc}')}")


def available_isas() -> list[str]:
    """The kernel variants this CPU can run, e.g. ``["avx2", "avx512"]``."""
    return [name for name, code in ISAS.items() if _lib.si_isa_supported(code)]


def best_isa() -> str:
    """The variant ``"auto"`` picks: ``"avx512"`` where the CPU has AVX-512 with VNNI, else
    ``"avx2_128"`` on CPUs whose vector units split 256-bit instructions (AMD Zen, Zen+), else
    ``"avx2_vnni"`` where the CPU has AVX-VNNI (Intel from Alder Lake), else ``"avx2"``."""
    code = _lib.si_best_isa()
    return next(name for name, c in ISAS.items() if c == code)


def set_isa(name: str = "auto") -> None:
    """Use the ``"avx2"``, ``"avx2_vnni"``, ``"avx2_128"`` or ``"avx512"`` kernels, or ``"auto"``
    (``best_isa``)."""
    if name == "auto":
        name = best_isa()
    if name not in ISAS:
        raise ValueError(f"isa: expected one of {['auto', *ISAS]}, got {name!r}")
    if _lib.si_set_isa(ISAS[name]) != 0:
        raise ValueError(f"isa: this CPU supports {available_isas()}, got {name!r}")


def get_isa() -> str:
    code = _lib.si_get_isa()
    return next(name for name, c in ISAS.items() if c == code)


def set_threads(n: int) -> None:
    """Threads for every call (the calling thread included); the pool is started here, once."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads: expected an int >= 1, got {n!r}")
    _check(_lib.si_set_threads(n), f"set_threads({n})")


def get_threads() -> int:
    return _lib.si_get_threads()


def set_spin_us(us: int) -> None:
    """How long an idle worker (or the waiting caller) spins before it sleeps, in µs."""
    _lib.si_set_spin_us(int(us))


def pool_stats(reset: bool = False) -> tuple[int, int]:
    """(chunks run by the calling thread, chunks run by the pool's workers) since the last
    reset: shows whether the other threads take part."""
    caller, workers = ctypes.c_longlong(), ctypes.c_longlong()
    _lib.si_pool_stats(ctypes.byref(caller), ctypes.byref(workers), int(reset))
    return caller.value, workers.value


# The phases of a decode block (DecodeBlock, DecodeStack) ``block_times`` splits its time into:
# the attention norm and QKV product; rope, the KV cache and attention; the output projection;
# the sparse FFN's predictor and neuron selection; its q4 gate rows (int8 bundles with the
# gates apart); the FFN's rows (sparse) or its products and activation (dense); the rest
# (residual adds, the FFN norm).
BLOCK_PHASES = ("qkv", "attention", "wo", "predictor", "gates", "ffn", "rest")


def set_block_timing(on: bool) -> None:
    """Time the decode blocks' phases from now on (``block_times``), or stop: off, as by
    default, the blocks read no clock."""
    _lib.si_set_block_timing(int(bool(on)))


def block_times(reset: bool = False) -> dict[str, float]:
    """Seconds spent in each of ``BLOCK_PHASES`` by the decode blocks' calls timed since the last
    reset (wall time, summed over layers and calls; the whole step, pool dispatches included)."""
    ns = (ctypes.c_longlong * len(BLOCK_PHASES))()
    _check(_lib.si_block_times(ns, len(BLOCK_PHASES), int(reset)), "block_times")
    return {name: v / 1e9 for name, v in zip(BLOCK_PHASES, ns)}


def _ptr(a: torch.Tensor | np.ndarray) -> int:
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    return a.__array_interface__["data"][0]


def _check_kv(k: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether KV caches ``k``/``v`` (contiguous CPU tensors of ``shape``, float32 or float16,
    both alike) hold float16; ValueError saying what was expected otherwise."""
    for name, t in (("k_cache", k), ("v_cache", v)):
        if not (isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16)
                and t.dtype == k.dtype and t.is_contiguous() and t.device.type == "cpu"
                and tuple(t.shape) == shape):
            raise ValueError(f"{name}: expected a contiguous CPU float32 or float16 tensor "
                             f"{list(shape)} (k and v alike), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    return k.dtype == torch.float16


def _check_f32(a: torch.Tensor | np.ndarray, shape: tuple[int, ...], what: str) -> None:
    if isinstance(a, torch.Tensor):
        ok = a.dtype == torch.float32 and a.is_contiguous() and a.device.type == "cpu"
    elif isinstance(a, np.ndarray):
        ok = a.dtype == np.float32 and a.flags.c_contiguous
    else:
        raise ValueError(f"{what}: expected a float32 torch tensor or numpy array, got "
                         f"{type(a).__name__}")
    if not ok or tuple(a.shape) != shape:
        raise ValueError(f"{what}: expected contiguous float32 {list(shape)}, got {a.dtype} "
                         f"{list(a.shape)}")


def _check_rows_x(x: torch.Tensor, d_model: int) -> int:
    """The row count B of ``x``, float32 [B >= 1, d_model] (one token per sequence)."""
    B = x.shape[0] if x.dim() == 2 else 0
    _check_f32(x, (B, d_model), "x")
    if B < 1:
        raise ValueError("x: expected at least one row")
    return B


def _check_rope(t: torch.Tensor, name: str, hd: int, min_rows: int = 0) -> None:
    """A rope table: contiguous float32 [positions >= min_rows, hd]."""
    _check_f32(t, (t.shape[0] if t.dim() == 2 else 0, hd), name)
    if t.shape[0] < min_rows:
        raise ValueError(f"{name}: expected at least {min_rows} rows, got {t.shape[0]}")


def _check_rows_at(positions: torch.Tensor, slots: torch.Tensor, B: int, max_seq: int,
                   n_slots: int) -> None:
    """Each row's position and cache slot: contiguous int32 [B], within the cache."""
    for name, t, hi in (("positions", positions, max_seq), ("slots", slots, n_slots)):
        if t.dtype != torch.int32 or not t.is_contiguous() or tuple(t.shape) != (B,):
            raise ValueError(f"{name}: expected contiguous int32 [{B}], got {t.dtype} "
                             f"{list(t.shape)}")
        if not (0 <= int(t.min()) and int(t.max()) < hi):
            raise ValueError(f"{name}: expected values in [0, {hi}), got {t.tolist()}")


def to_panels(raw: np.ndarray, type_name: str, rows: int, cols: int, panel: str) -> np.ndarray:
    """``panels.to_panels_ref`` on the library's pool: rows of a ``panels.PANEL_TYPES`` type as
    the file stores them -> the same bytes in panels of 16 rows of type ``panel`` (a new array;
    qgemv.h has the layout)."""
    src = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(-1)
    check_panel_shape(src, type_name, rows, cols)
    out = np.empty(src.size, dtype=np.uint8)
    _check(_lib.si_to_panels(TYPES[panel][0], src.ctypes.data, rows, cols, out.ctypes.data),
           "to_panels")
    return out


def bundle_rows(raw: np.ndarray, type_name: str, rows: int, cols: int, transpose: bool,
                out: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Neuron rows from a Q4_0 or F16 matrix ``raw`` (the file's bytes, [rows, cols]) into
    ``out``: its rows (gate/up, a converted file's down_t) or, ``transpose``, its columns (a Q4_0
    down), quantized per 32 as ``sparse.packed``'s ``quantize_q4_rows`` (``out`` uint8
    [n, L / 32 · 18]) or ``quantize_int8`` with block 32 (``out`` int8 [n, L], ``scales`` float32
    [n, L / 32]) quantize the float weights, bit for bit, on the library's pool; a Q4_0 matrix's
    rows into q4 rows keep their numbers (``sparse.packed.q4_rows``: the bytes moved). ``out`` and
    ``scales`` may be views with a row stride (``PackedFFN.rows[:, m]``); their rows must be
    contiguous."""
    if type_name not in ("Q4_0", "F16"):
        raise ValueError(f"bundle_rows: expected a Q4_0 or F16 matrix, got {type_name}")
    src = np.ascontiguousarray(np.asarray(raw).view(np.uint8)).reshape(-1)
    row_bytes = 2 * cols if type_name == "F16" else cols // 32 * 18
    if rows < 1 or cols % 32 or src.size != rows * row_bytes or (transpose and rows % 32):
        raise ValueError(f"bundle_rows: expected a {type_name} matrix of {rows} x {cols} (cols, "
                         f"and rows when transposed, multiples of 32) in {rows * row_bytes} "
                         f"bytes, got {src.size} bytes")
    n, length = (cols, rows) if transpose else (rows, cols)
    i8 = out.dtype == torch.int8
    width = length if i8 else length // 32 * 18
    if out.dtype not in (torch.int8, torch.uint8) or tuple(out.shape) != (n, width) or (
            out.stride(1) != 1):
        raise ValueError(f"bundle_rows: expected out int8 or uint8 of shape {(n, width)} with "
                         f"contiguous rows, got {out.dtype} {tuple(out.shape)} strides "
                         f"{out.stride()}")
    if i8 and (scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (
            n, length // 32) or scales.stride(1) != 1):
        raise ValueError(f"bundle_rows: int8 rows need scales float32 of shape {(n, length // 32)}"
                         f" with contiguous rows, got {None if scales is None else scales.shape}")
    sp, ss = (scales.data_ptr(), scales.stride(0)) if i8 else (None, 0)
    _check(_lib.si_bundle_rows(TYPES[type_name][0], src.ctypes.data, rows, cols, int(transpose),
                               int(i8), out.data_ptr(), out.stride(0) * out.element_size(), sp,
                               ss), "bundle_rows")


def _check_vector_k(x: torch.Tensor, k: int) -> int:
    """x a 1-D contiguous float32 CPU tensor of n >= k >= 1 values; returns n."""
    n = x.shape[0] if x.dim() == 1 else 0
    _check_f32(x, (n,), "x")
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= {n}, got {k}")
    return n


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)`` of a 1-D contiguous float32 CPU tensor: (values, int64 indices),
    largest first; equal values lower index first; NaN only when fewer than k other values.
    One pass that skips, four at a time, whatever is below the k-th best so far (sampling's
    top-k over a vocabulary: a few µs instead of torch's tens)."""
    n = _check_vector_k(x, k)
    vals, ids = torch.empty(k), torch.empty(k, dtype=torch.int64)
    _check(_lib.si_topk(x.data_ptr(), n, k, vals.data_ptr(), ids.data_ptr()), "topk")
    return vals, ids


def sample_topk(x: torch.Tensor, k: int, top_p: float, min_p: float, temperature: float,
                u: float) -> int:
    """``generate.sample_ref``'s draw after top-k in one C call: the k best of a 1-D contiguous
    float32 CPU tensor, top-p, min-p, temperature, and the candidate that uniform ``u`` in
    [0, 1) picks. Returns its index into ``x``."""
    n = _check_vector_k(x, k)
    if not temperature > 0.0 or not 0.0 <= u < 1.0:
        raise ValueError(f"expected temperature > 0 and 0 <= u < 1, got {temperature} and {u}")
    out = ctypes.c_int64()
    _check(_held(x.data_ptr(), n, k, top_p, min_p, temperature, u, ctypes.byref(out)),
           "sample_topk")
    return out.value


def read_runs(fd: int, start: np.ndarray, length: np.ndarray, first: np.ndarray,
              pick: np.ndarray, dest: np.ndarray, stride: int, out: np.ndarray, align: int,
              threads: int, drop: bool) -> tuple[int, int, int, tuple[int, int, int] | None]:
    """The disk tier's reads in C, ``threads`` in flight, without the GIL (``disk.reader``):
    run i is the file bytes ``[start[i], start[i] + length[i])`` of ``fd``, read with one
    ``pread`` over that range widened to multiples of ``align`` (O_DIRECT's rule; 4096 if the
    device refuses less); its wanted rows ``j`` in ``[first[i], first[i + 1])`` are the bytes
    ``[pick[j] * stride, + row)`` of the run, copied to row ``dest[j]`` of ``out`` ([k, row]
    uint8, C-contiguous). ``drop``: each range read is dropped from the page cache (reads
    without O_DIRECT). Returns (bytes read, reads, the alignment used, failure): failure None, or
    (run, errno, bytes got) of the first run that failed (errno 0: a short read), after which no
    further run starts."""
    n = len(start)
    if out.dtype != np.uint8 or out.ndim != 2 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected C-contiguous uint8 [k, row], got {out.dtype} "
                         f"{list(out.shape)}")
    k, row = out.shape
    start, length, first, dest = (np.ascontiguousarray(a, dtype=np.int64)
                                  for a in (start, length, first, dest))
    pick = np.ascontiguousarray(pick, dtype=np.int32)
    if len(length) != n or len(first) != n + 1 or len(pick) != len(dest) or \
            (n and (first[0] != 0 or first[-1] != len(pick))):
        raise ValueError(f"expected start and length of {n} runs, first of {n + 1} ending at "
                         f"{len(pick)} picks, one dest per pick; got {len(length)}, "
                         f"{len(first)}, {len(dest)}")
    if len(dest) and (dest.min() < 0 or dest.max() >= k):
        raise ValueError(f"dest: expected rows of out (0..{k - 1})")
    stats = np.zeros(3, dtype=np.int64)
    fail = np.zeros(3, dtype=np.int64)
    rc = _lib.si_read_runs(fd, n, _ptr(start), _ptr(length), _ptr(first), _ptr(pick),
                           _ptr(dest), stride, row, _ptr(out), align, threads, int(drop),
                           _ptr(stats), _ptr(fail))
    if rc and rc != errno.EIO:  # EIO: a read failed, reported below
        _check(rc, "read_runs")
    failure = (int(fail[0]), int(fail[1]), int(fail[2])) if rc else None
    return int(stats[0]), int(stats[1]), int(stats[2]), failure


class QuantMatrix:
    """A ``rows × cols`` weight matrix held as GGUF blocks of type ``type_name``.

    ``raw``: the tensor's bytes (uint8 numpy array, e.g. a read-only memmap, or a uint8 torch
    tensor), ``rows · cols / block_elems · block_bytes`` of them, C-contiguous. It is referenced,
    not copied: keep it alive and unchanged while this object is used (this object holds it).
    """

    __slots__ = ("type_name", "raw", "rows", "cols", "code", "ptr", "nbytes")

    def __init__(self, type_name: str, raw: np.ndarray | torch.Tensor, rows: int, cols: int):
        if type_name not in TYPES:
            raise ValueError(f"type: expected one of {list(TYPES)}, got {type_name!r}")
        code, elems, size = TYPES[type_name]
        step = max(elems, 32)
        if rows < 1 or cols < step or cols % step:
            raise ValueError(f"{type_name} matrix: expected rows >= 1 and cols a multiple of "
                             f"{step}, got rows={rows} cols={cols}")
        if type_name in FILE_TYPES and rows % PANEL:
            raise ValueError(f"{type_name} matrix: expected rows a multiple of {PANEL}, got "
                             f"{rows}")
        if isinstance(raw, torch.Tensor):
            ok = raw.dtype == torch.uint8 and raw.is_contiguous() and raw.device.type == "cpu"
        elif isinstance(raw, np.ndarray):
            ok = raw.dtype == np.uint8 and raw.flags.c_contiguous
        else:
            raise ValueError(f"raw: expected a uint8 numpy array or torch tensor, got "
                             f"{type(raw).__name__}")
        if not ok:
            raise ValueError(f"raw: expected C-contiguous uint8 bytes, got {raw.dtype}")
        nbytes = rows * (cols // elems) * size
        if raw.size != nbytes if isinstance(raw, np.ndarray) else raw.numel() != nbytes:
            n = raw.size if isinstance(raw, np.ndarray) else raw.numel()
            raise ValueError(f"{type_name} [{rows}, {cols}]: expected {nbytes} bytes, got {n}")
        self.type_name, self.raw, self.rows, self.cols = type_name, raw, rows, cols
        self.code, self.ptr, self.nbytes = code, _ptr(raw), nbytes

    def __repr__(self) -> str:
        return f"QuantMatrix({self.type_name}, rows={self.rows}, cols={self.cols})"

    @property
    def file_type(self) -> str:
        """The GGUF type of the blocks (a panel type's source type)."""
        return FILE_TYPES.get(self.type_name, self.type_name)

    def file_rows(self) -> np.ndarray:
        """The blocks as the file lays them out: uint8 [rows, row bytes] (panels undone)."""
        raw = self.raw.numpy() if isinstance(self.raw, torch.Tensor) else np.asarray(self.raw)
        if self.type_name in FILE_TYPES:
            return from_panels(raw, FILE_TYPES[self.type_name], self.rows, self.cols,
                               self.type_name)
        return raw.reshape(self.rows, -1)


class GemvPlan:
    """``gemv(mats, x, outs)`` with its argument arrays built once: ``plan(x)`` for the hot path
    (``outs`` are fixed; ``x`` must be a contiguous float32 CPU tensor/array of ``cols``). With
    ``each``, matrix i against its own row i of ``x`` [len(mats), cols] (``gemm_each`` of one
    row each, one dispatch: a mixture of experts' down products for one token)."""

    __slots__ = ("mats", "outs", "cols", "_n", "_types", "_ptrs", "_rows", "_outp", "_x", "_call")

    def __init__(self, mats: Sequence[QuantMatrix], outs: Sequence[torch.Tensor | np.ndarray],
                 each: bool = False):
        if not mats or len(mats) != len(outs):
            raise ValueError(f"expected as many outputs as matrices (>= 1), got {len(mats)} "
                             f"matrices and {len(outs)} outputs")
        if len(mats) > 16:
            raise ValueError(f"expected at most 16 matrices per call, got {len(mats)}")
        cols = {m.cols for m in mats}
        if len(cols) != 1:
            raise ValueError(f"expected matrices sharing one input width, got cols {sorted(cols)}")
        for i, (m, o) in enumerate(zip(mats, outs)):
            _check_f32(o, (m.rows,), f"outs[{i}]")
        n = len(mats)
        self.mats, self.outs, self.cols, self._n = list(mats), list(outs), cols.pop(), n
        self._types = (ctypes.c_int * n)(*[m.code for m in mats])
        self._ptrs = (ctypes.c_void_p * n)(*[m.ptr for m in mats])
        self._rows = (ctypes.c_int64 * n)(*[m.rows for m in mats])
        self._outp = (ctypes.c_void_p * n)(*[_ptr(o) for o in outs])
        self._x = (n, self.cols) if each else (self.cols,)
        self._call = _lib.si_gemv_each if each else _gemv

    def set_mats(self, mats: Sequence[QuantMatrix]) -> None:
        """Other matrices of the same heights and width into the same outputs (a mixture of
        experts' picked experts, token by token), without building the plan again."""
        if len(mats) != self._n:
            raise ValueError(f"expected {self._n} matrices, got {len(mats)}")
        for i, m in enumerate(mats):
            if m.cols != self.cols or m.rows != self._rows[i]:
                raise ValueError(f"mats[{i}]: expected [{self._rows[i]}, {self.cols}], got "
                                 f"[{m.rows}, {m.cols}]")
            self._types[i], self._ptrs[i] = m.code, m.ptr
        self.mats = list(mats)

    def __call__(self, x: torch.Tensor | np.ndarray) -> None:
        if not (type(x) is torch.Tensor and x.dtype is torch.float32 and x.shape == self._x
                and x.is_contiguous() and not x.is_cuda):
            _check_f32(x, self._x, "x")  # numpy arrays, or the error
        rc = self._call(self._n, self._types, self._ptrs, self._rows, self.cols, _ptr(x),
                        self._outp)
        if rc:
            _check(rc, "gemv")


_plans: dict[tuple, GemvPlan] = {}
MAX_CACHED_PLANS = 1024


def gemv(mats: Sequence[QuantMatrix], x: torch.Tensor | np.ndarray,
         outs: Sequence[torch.Tensor | np.ndarray]) -> None:
    """``outs[i] = mats[i] @ x`` for matrices sharing one input ``x`` (float32 [cols]); each
    ``outs[i]`` a preallocated contiguous float32 [rows_i]. ``x`` is quantized once and all the
    rows go to the thread pool in one dispatch. The argument arrays are cached per (matrices,
    output buffers), so a decode loop that reuses its buffers pays for them once (a
    ``GemvPlan`` skips even the cache lookup)."""
    key = (*mats, *[(_ptr(o), o.shape, o.dtype) for o in outs])
    plan = _plans.get(key)
    if plan is None:
        if mats:
            _check_f32(x, (mats[0].cols,), "x")
        plan = GemvPlan(mats, outs)
        if len(_plans) >= MAX_CACHED_PLANS:
            _plans.clear()
        _plans[key] = plan
    plan(x)


def gemm_each(mats: Sequence[QuantMatrix], x: torch.Tensor, counts: Sequence[int],
              outs: Sequence[torch.Tensor]) -> None:
    """``outs[i] = x_i @ mats[i].T`` where ``x_i`` are the next ``counts[i]`` rows of ``x``
    (float32 [sum(counts), cols], taken in order): matrices sharing one width, each against its
    own rows (a mixture of experts' prompt: each expert the rows of the tokens that picked it),
    up to 16 a call; ``outs[i]`` contiguous float32 [counts[i], rows_i]. The rows are quantized
    in one pass and all the products go to the pool in one dispatch; each row's result is its
    ``gemv`` bit for bit."""
    n = len(mats)
    if not 1 <= n <= 16 or len(counts) != n or len(outs) != n:
        raise ValueError(f"expected 1 to 16 matrices with as many row counts and outputs, got "
                         f"{n} matrices, {len(counts)} counts, {len(outs)} outputs")
    cols = mats[0].cols
    if any(m.cols != cols for m in mats) or min(counts) < 1:
        raise ValueError(f"expected matrices of one width and row counts >= 1, got cols "
                         f"{sorted({m.cols for m in mats})} and counts {list(counts)}")
    _check_f32(x, (sum(counts), cols), "x")
    for i, (m, c, o) in enumerate(zip(mats, counts, outs)):
        _check_f32(o, (c, m.rows), f"outs[{i}]")
    rc = _lib.si_gemm_each(n, (ctypes.c_int * n)(*[m.code for m in mats]),
                           (ctypes.c_void_p * n)(*[m.ptr for m in mats]),
                           (ctypes.c_int64 * n)(*[m.rows for m in mats]), cols, _ptr(x),
                           (ctypes.c_int64 * n)(*counts),
                           (ctypes.c_void_p * n)(*[_ptr(o) for o in outs]))
    if rc:
        _check(rc, "gemm_each")


def gemm(mat: QuantMatrix, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ mat.T`` for ``x`` float32 [T, cols] (e.g. a prompt): [T, rows] (into ``out`` if
    given). Each weight tile is read once and multiplied with every row of ``x``."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, {mat.cols}], got {list(x.shape)}")
    T = x.shape[0]
    _check_f32(x, (T, mat.cols), "x")
    if out is None:
        out = torch.empty(T, mat.rows)
    _check_f32(out, (T, mat.rows), "out")
    _check(_lib.si_gemm(mat.code, mat.ptr, mat.rows, mat.cols, _ptr(x), T, _ptr(out)), "gemm")
    return out


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 blocks the kernels make of ``x`` (float32 [cols]): ``(q [cols] int8, d [cols/32],
    s [cols/32])`` with ``x ≈ q · d`` per block and ``s = d · sum(q)``."""
    cols = x.shape[-1]
    _check_f32(x, (cols,), "x")
    q, d, s = torch.empty(cols, dtype=torch.int8), torch.empty(cols // 32), torch.empty(cols // 32)
    _check(_lib.si_quantize_x(_ptr(x), cols, _ptr(q), _ptr(d), _ptr(s)), "quantize_x")
    return q, d, s


def quantize_xk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks of 128 the K-quant kernels that sum half a super-block in integers make of
    ``x`` (float32 [cols], cols a multiple of 128; plain AVX2's Q6_K, AVX-512's Q5_K/Q6_K),
    by the selected ISA's code: ``(q [cols] int8, d [cols/128], bsums [cols/16] int16, ks
    [cols/32])`` with ``x ≈ q · d`` per block, ``bsums`` the sums of q per 16 and ``ks`` d times
    the sums of q per 32."""
    cols = x.shape[-1]
    _check_f32(x, (cols,), "x")
    q, d = torch.empty(cols, dtype=torch.int8), torch.empty(cols // 128)
    bs, ks = torch.empty(cols // 16, dtype=torch.int16), torch.empty(cols // 32)
    _check(_lib.si_quantize_xk(_ptr(x), cols, _ptr(q), _ptr(d), _ptr(bs), _ptr(ks)), "quantize_xk")
    return q, d, bs, ks


def _check_idx_bias(idx: torch.Tensor, up_bias: torch.Tensor | None, d_ff: int,
                    mask: torch.Tensor | None = None, T: int = 1) -> tuple[int | None, int | None]:
    """The sparse FFN calls' neuron list (contiguous int32), bias (float32 [d_ff] or None) and
    per-token mask (contiguous bool or uint8 [T, len(idx)], or None); returns the bias and mask
    pointers (None for none)."""
    if idx.dtype != torch.int32 or not idx.is_contiguous():
        raise ValueError(f"idx: expected contiguous int32, got {idx.dtype}")
    if mask is not None and (mask.dtype not in (torch.bool, torch.uint8)
                             or not mask.is_contiguous() or tuple(mask.shape) != (T, idx.numel())):
        raise ValueError(f"mask: expected contiguous bool or uint8 [{T}, {idx.numel()}], got "
                         f"{mask.dtype} {list(mask.shape)}")
    if up_bias is not None:
        _check_f32(up_bias, (d_ff,), "up_bias")
    return (None if up_bias is None else up_bias.data_ptr(),
            None if mask is None else mask.data_ptr())


def _check_q4_bundles(rows: torch.Tensor, d_model: int) -> None:
    """ValueError unless ``rows`` are contiguous uint8 q4 bundles ``[d_ff, n_mats, d_model / 32
    · 18]`` (``sparse_ffn_q4``'s)."""
    width = d_model // 32 * 18
    if rows.dtype != torch.uint8 or not rows.is_contiguous() or rows.shape[-1] != width:
        raise ValueError(f"rows: expected contiguous uint8 [d_ff, n_mats, {width}], got "
                         f"{rows.dtype} {list(rows.shape)}")


def sparse_ffn_q4(rows: torch.Tensor, gated: bool, idx: torch.Tensor, x: torch.Tensor,
                  out: torch.Tensor, gate_act: int, up_act: int,
                  up_bias: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse FFN over neuron bundles of q4 rows: ``out[t] = sum_{i in idx} h_i(x[t]) ·
    down_i`` with ``h_i = act_g(gate_i · x) · act_u(up_i · x)`` (gated) or ``act_u(up_i · x +
    b_i)``. ``rows``: uint8 ``[d_ff, n_mats, d_model / 32 · 18]`` (per neuron: [gate,] up, down
    column, each a q4 row: ``sparse.packed.q4_rows``); ``idx`` int32 [k]; ``x``, ``out`` float32
    [T, d_model]; activation codes as ``sparse.kernels.ACT_CODES`` (0 identity, 1 relu, 2 silu,
    3 gelu, 4 gelu-tanh). Only the active neurons' bytes are read, 4 neurons at a time; with a
    ReLU gate (ReGLU, dReLU) the gate rows go first and a neuron's up row is read only if its
    gate fired (its down row only if h is not 0); ``x`` is rounded to int8 blocks as in
    ``gemv``.
    ``mask`` (bool or uint8 [T, k], optional): token t takes only the neurons ``idx[i]`` with
    ``mask[t, i]`` (its own set within the union ``idx``: each bundle still read once for all).
    (Reference: ``sparse.reference.sparse_ffn_ref`` on a ``PackedFFN`` of dtype "q4".)"""
    d_ff, n_mats, width = rows.shape
    if x.dim() != 2:
        raise ValueError(f"x: expected float32 [T, d_model], got {list(x.shape)}")
    T, d_model = x.shape
    _check_f32(x, (T, d_model), "x")
    _check_f32(out, (T, d_model), "out")
    _check_q4_bundles(rows, d_model)
    bias, mk = _check_idx_bias(idx, up_bias, d_ff, mask, T)
    _check(_lib.si_sparse_q4(rows.data_ptr(), n_mats * width, int(gated), idx.data_ptr(),
                             idx.shape[0], mk, d_ff, x.data_ptr(), T, d_model, gate_act, up_act,
                             bias, out.data_ptr()), "sparse_ffn_q4")
    return out


def sparse_q4_gates(rows: torch.Tensor, idx: torch.Tensor, x: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw gate dot products ``z[i] = gate_{idx[i]} · x`` (before the activation) of q4
    neuron bundles, for one token ``x`` (float32 [d_model]), by exactly the arithmetic of
    ``sparse_ffn_q4``'s ReLU gates on the same x (rounded to int8 blocks as it rounds it): for
    ReGLU / dReLU, ``z[i] > 0`` is exactly that kernel's "gate fired" and ``relu(z[i])`` its gate
    value, for a call over any set holding neuron ``idx[i]`` (each neuron's gate is the same bits
    wherever it falls among the kernel's passes; ``sparse.kernels.gate_dots`` says what that
    makes equal). ``rows``: the bundles of ``sparse_ffn_q4``
    (uint8 ``[d_ff, n_mats, d_model / 32 · 18]``, contiguous; the gate is row 0 of each), or
    the gate rows alone, uint8 ``[d_ff, d_model / 32 · 18]`` with contiguous rows any stride
    apart (e.g. ``bundles[:, 0]``, or an array of gate rows): only each neuron's gate row is
    read. ``idx`` int32 [k]; ``out`` float32 [k] (allocated if None). Over the library's pool.
    (Reference: the dequantized gate rows · ``cpu.reference.rounded_x(x)``.)"""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() not in (2, 3):
        raise ValueError(f"rows: expected uint8 [d_ff, n_mats, width] bundles or [d_ff, width] "
                         f"gate rows, got {getattr(rows, 'dtype', type(rows).__name__)} "
                         f"{list(getattr(rows, 'shape', ()))}")
    if rows.dim() == 3:
        if not rows.is_contiguous():
            raise ValueError("rows: expected contiguous bundles [d_ff, n_mats, width]")
        rows = rows[:, 0]
    if x.dim() != 1:
        raise ValueError(f"x: expected float32 [d_model] (one token), got {list(x.shape)}")
    d_model = x.shape[0]
    _check_f32(x, (d_model,), "x")
    d_ff, width = rows.shape
    if d_model % 32 or width != d_model // 32 * 18:
        raise ValueError(f"rows: expected rows of {d_model // 32 * 18} bytes (q4 rows of d_model "
                         f"{d_model}, a multiple of 32), got {list(rows.shape)}")
    if rows.device.type != "cpu" or (d_ff > 1 and (rows.stride(1) != 1
                                                   or rows.stride(0) < width)):
        raise ValueError(f"rows: expected CPU rows of contiguous bytes, apart by at least their "
                         f"width, got strides {list(rows.stride())}")
    _check_idx_bias(idx, None, d_ff)
    k = idx.shape[0]
    if out is None:
        out = torch.empty(k)
    _check_f32(out, (k,), "out")
    _check(_lib.si_sparse_q4_gates(rows.data_ptr(), rows.stride(0) if d_ff > 1 else width,
                                   idx.data_ptr(), k, d_ff, x.data_ptr(), d_model,
                                   out.data_ptr()), "sparse_q4_gates")
    return out


def read_gather(buf: torch.Tensor, stride: int, nbytes: int, idx: torch.Tensor) -> int:
    """A read probe for benchmarks: bytes ``[0, nbytes)`` of rows ``idx`` (int32) of ``buf`` (a
    contiguous CPU tensor, 8-byte aligned; rows ``stride`` bytes apart), read in the order and
    with the look-ahead the sparse kernels read their neuron bundles, on the pool's threads,
    doing nothing else. Returns the wrapping sum of the 64-bit words read, mod 2**64 (so a test
    can check that every byte was read). ``nbytes`` and ``stride``: multiples of 8."""
    if not (isinstance(buf, torch.Tensor) and buf.is_contiguous() and buf.device.type == "cpu"):
        raise ValueError(f"buf: expected a contiguous CPU tensor, got {type(buf).__name__}")
    if not (isinstance(idx, torch.Tensor) and idx.dtype == torch.int32 and idx.dim() == 1
            and idx.is_contiguous()):
        raise ValueError(f"idx: expected a contiguous 1-D int32 tensor, got "
                         f"{getattr(idx, 'dtype', type(idx).__name__)}")
    if nbytes % 8 or stride % 8 or not 0 < nbytes <= stride or buf.data_ptr() % 8:
        raise ValueError(f"read_gather: expected 0 < nbytes <= stride, both multiples of 8, and "
                         f"an 8-byte aligned buf; got nbytes {nbytes}, stride {stride}, buf at "
                         f"{buf.data_ptr() % 8} mod 8")
    total = buf.numel() * buf.element_size()
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi * stride + nbytes > total:
            raise ValueError(f"idx: expected rows 0..{(total - nbytes) // stride} of a "
                             f"{total}-byte buf, got {lo}..{hi}")
    out = ctypes.c_uint64()
    _check(_lib.si_read_gather(buf.data_ptr(), total, stride, nbytes, idx.data_ptr(), idx.numel(),
                               ctypes.byref(out)), "read_gather")
    return out.value


def i8_rounds_x(block: int, d_model: int) -> bool:
    """Whether ``sparse_ffn_i8`` can round x to int8 per 32 for int8 rows of this scale block
    and width (its default where it can)."""
    return block % 32 == 0 and d_model % 32 == 0


def sparse_ffn_i8(rows: torch.Tensor, scales: torch.Tensor | None, block: int, gated: bool,
                  idx: torch.Tensor, x: torch.Tensor, out: torch.Tensor, gate_act: int,
                  up_act: int, up_bias: torch.Tensor | None = None,
                  round_x: bool | None = None, mask: torch.Tensor | None = None,
                  gates: torch.Tensor | None = None) -> torch.Tensor:
    """``sparse_ffn_q4`` over int8 neuron bundles (``PackedFFN`` dtype "int8"): ``rows`` int8
    ``[d_ff, n_mats, d_model]``, ``scales`` float32 ``[d_ff, n_mats, ceil(d_model / block)]``
    (one per ``block`` weights of a row; ``block`` and ``d_model`` multiples of 8).
    ``round_x``: the gate/up dot products take ``x`` rounded to int8 per 32 as ``gemv`` does
    (integer products; needs ``block`` and ``d_model`` multiples of 32, the default where they
    are), else ``x`` stays float32 and the weights are converted. The down rows always take the
    float coefficients. ReLU gates first and ``mask`` as ``sparse_ffn_q4``'s. ``gates`` (a
    ReLU gate, x rounded): the gate rows apart as q4 rows, uint8 ``[d_ff, d_model / 32 · 18]``
    with contiguous rows any stride apart (``PackedFFN.gates``: the file's Q4_0 gate rows,
    ``sparse.packed.q4_rows``): the gates are their products by ``sparse_q4_gates``' arithmetic
    and ``rows`` may hold the up and down rows alone (``[d_ff, 2, d_model]``; with 3, the int8
    gate rows are not read). With the gates apart, ``rows`` may instead be bundles of q4 ups
    (``PackedFFN`` dtype "q4i8": uint8 ``[d_ff, 1, q4i8_layout(d_model, block).width]``, each
    neuron's down-row scales, up row as a q4 row and int8 down row; ``scales`` None): the up
    products by the gates' arithmetic. (Reference: ``sparse.reference.sparse_ffn_ref`` on a
    ``PackedFFN`` of dtype "int8", on ``cpu.reference.quantize_x_ref``'s x where rounded; with
    ``gates``, on their dequantized rows.)"""
    d_ff, d_model, T, round_x = _check_i8(rows, scales, block, gated, x, out, round_x,
                                          gates is not None)
    bias, mk = _check_idx_bias(idx, up_bias, d_ff, mask, T)
    gp, gstride = None, 0
    if gates is not None:
        if not gated or gate_act != 1 or not round_x:
            raise ValueError(f"gates: q4 gate rows apart need a ReLU gate (code 1) and x rounded "
                             f"(round_x), got gated {gated}, gate_act {gate_act}, round_x "
                             f"{round_x}")
        gp, gstride = _q4_gate_rows(gates, d_ff, d_model)
    q4u = rows.dtype == torch.uint8
    _check(_lib.si_sparse_i8(rows.data_ptr(), None if q4u else scales.data_ptr(), block,
                             int(gated), rows.shape[1], idx.data_ptr(), idx.shape[0], mk, d_ff,
                             x.data_ptr(), int(round_x), T, d_model, gate_act, up_act, bias,
                             out.data_ptr(), gp, gstride, int(q4u)),
           "sparse_ffn_i8")
    return out


def _check_x_out(x: torch.Tensor, out: torch.Tensor, d_model: int | None = None) -> int:
    """x and out: float32 [T, d_model] (d_model None: x's); T."""
    if x.dim() != 2 or (d_model is not None and x.shape[1] != d_model):
        raise ValueError(f"x: expected float32 [T, {d_model or 'd_model'}], got {list(x.shape)}")
    T = x.shape[0]
    _check_f32(x, (T, x.shape[1]), "x")
    _check_f32(out, (T, x.shape[1]), "out")
    return T


def _check_i8(rows: torch.Tensor, scales: torch.Tensor | None, block: int, gated: bool,
              x: torch.Tensor, out: torch.Tensor, round_x: bool | None,
              apart: bool = False) -> tuple[int, int, int, bool]:
    """The int8 bundles' arguments of ``sparse_ffn_i8`` checked (``apart``: q4 gate rows given,
    the bundles with or without their int8 gate rows, or uint8 bundles of q4 ups):
    ``(d_ff, d_model, T, round_x)``, round_x's default decided."""
    if apart and rows.dtype == torch.uint8:
        return _check_q4u(rows, scales, block, gated, x, out, round_x)
    d_ff, n_mats, d_model = rows.shape
    T = _check_x_out(x, out, d_model)
    mats = "2 or 3" if apart else 3 if gated else 2
    if (rows.dtype != torch.int8 or not rows.is_contiguous()
            or n_mats not in ((2, 3) if apart else (3 if gated else 2,))):
        raise ValueError(f"rows: expected contiguous int8 [d_ff, {mats}, d_model], got "
                         f"{rows.dtype} {list(rows.shape)}")
    if d_model % 8 or block <= 0 or block % 8 or block > d_model:
        raise ValueError(f"block, d_model: expected multiples of 8 with block <= d_model, got "
                         f"{block}, {d_model}")
    if round_x is None:
        round_x = i8_rounds_x(block, d_model)
    elif round_x and not i8_rounds_x(block, d_model):
        raise ValueError(f"round_x: block and d_model must be multiples of 32, got {block}, "
                         f"{d_model}")
    _check_f32(scales, (d_ff, n_mats, -(-d_model // block)), "scales")
    return d_ff, d_model, T, round_x


def _check_q4u(rows: torch.Tensor, scales: torch.Tensor | None, block: int, gated: bool,
               x: torch.Tensor, out: torch.Tensor,
               round_x: bool | None) -> tuple[int, int, int, bool]:
    """``_check_i8`` for bundles of q4 ups (``PackedFFN`` dtype "q4i8"; d_model is x's)."""
    from ..sparse.packed import q4i8_layout

    T = _check_x_out(x, out)
    d_model = x.shape[1]
    if not gated or d_model % 32 or block <= 0 or block % 32 or block > d_model:
        raise ValueError(f"q4 ups: expected a gated FFN, d_model and block multiples of 32 with "
                         f"block <= d_model, got gated {gated}, {d_model}, {block}")
    if round_x is False:
        raise ValueError("round_x: q4 ups take x rounded to int8 per 32, got False")
    if scales is not None:
        raise ValueError("scales: expected None with q4 ups (each bundle holds its scales)")
    width = q4i8_layout(d_model, block).width
    if rows.dim() != 3 or rows.shape[1:] != (1, width) or not rows.is_contiguous():
        raise ValueError(f"rows: expected contiguous uint8 [d_ff, 1, {width}] bundles of q4 ups "
                         f"for d_model {d_model}, block {block}, got {list(rows.shape)}")
    return rows.shape[0], d_model, T, True


def _q4_gate_rows(gates: torch.Tensor, d_ff: int, d_model: int) -> tuple[int, int]:
    """The pointer and row stride (bytes) of q4 gate rows ``gates``, checked: CPU uint8
    ``[d_ff, d_model / 32 · 18]``, each row's bytes contiguous, rows at least a row apart."""
    width = d_model // 32 * 18
    if (not isinstance(gates, torch.Tensor) or gates.dtype != torch.uint8 or d_model % 32
            or tuple(gates.shape) != (d_ff, width) or gates.device.type != "cpu"
            or (d_ff > 1 and (gates.stride(1) != 1 or gates.stride(0) < width))):
        raise ValueError(f"gates: expected CPU uint8 [{d_ff}, {width}] q4 rows of contiguous "
                         f"bytes at least a row apart, got "
                         f"{getattr(gates, 'dtype', type(gates).__name__)} "
                         f"{list(getattr(gates, 'shape', ()))}")
    return gates.data_ptr(), gates.stride(0) if d_ff > 1 else width


def sparse_ffn_i8_q4g(rows: torch.Tensor, scales: torch.Tensor | None, block: int,
                      gates: torch.Tensor,
                      idx: torch.Tensor, x: torch.Tensor, out: torch.Tensor, up_act: int,
                      round_x: bool | None = None) -> torch.Tensor:
    """``sparse_ffn_i8`` for one token over gated int8 bundles of a ReLU gate whose gates are
    held apart as q4 rows (``gates``: uint8 ``[d_ff, d_model / 32 · 18]``, contiguous rows any
    stride apart, e.g. the file's Q4_0 gate rows as ``sparse.packed.q4_rows``; ``rows`` int8
    ``[d_ff, 2, d_model]``, up and down, or ``[d_ff, 3, d_model]`` whose int8 gate rows are not
    read): the gate dot products of ``idx``'s neurons over the q4 rows (``sparse_q4_gates``'
    arithmetic) on the pool, then the up and down rows of the neurons whose gate fired only.
    ``x``, ``out``: float32 [1, d_model]; ``round_x`` as ``sparse_ffn_i8``'s (for the up
    products). ``rows`` may be bundles of q4 ups as ``sparse_ffn_i8`` takes them (scales None).
    (Reference: ``sparse.reference.sparse_ffn_ref`` with the q4 rows' gates:
    ``tests/cpu/test_q4_gates.py``, ``test_q4_ups.py``.)"""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x: expected float32 [1, d_model] (one token), got {list(x.shape)}")
    d_ff, d_model, _, round_x = _check_i8(rows, scales, block, True, x, out, round_x, True)
    gp, gstride = _q4_gate_rows(gates, d_ff, d_model)
    _check_idx_bias(idx, None, d_ff)
    q4u = rows.dtype == torch.uint8
    _check(_lib.si_sparse_i8_q4g(rows.data_ptr(), None if q4u else scales.data_ptr(), block,
                                 rows.shape[1], gp, gstride, idx.data_ptr(), idx.shape[0], d_ff,
                                 x.data_ptr(), int(round_x), d_model, up_act, out.data_ptr(),
                                 int(q4u)),
           "sparse_ffn_i8_q4g")
    return out


class F16Predictor:
    """A predictor ``fc2 · relu(fc1 · x)`` in float16 for ``predict_f16``: the rank padded to a
    multiple of 32 with zero rows of fc1 and zero columns of fc2 (the logits are unchanged), and
    its scratch buffers. ``thresholds``: float32 [d_ff], neuron i is selected iff its logit >=
    ``thresholds[i]``."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, thresholds: torch.Tensor):
        r, d_model = fc1.shape
        d_ff = fc2.shape[0]
        if fc2.shape[1] != r or d_model % 32:
            raise ValueError(f"fc1/fc2: expected [r, d_model] (d_model a multiple of 32) and "
                             f"[d_ff, r], got {list(fc1.shape)} {list(fc2.shape)}")
        rp = -(-r // 32) * 32
        self.fc1 = torch.zeros(rp, d_model, dtype=torch.float16)
        self.fc1[:r] = fc1
        self.fc2 = torch.zeros(d_ff, rp, dtype=torch.float16)
        self.fc2[:, :r] = fc2
        self.thresholds = thresholds.float().contiguous()
        if self.thresholds.shape != (d_ff,):
            raise ValueError(f"thresholds: expected [{d_ff}], got {list(thresholds.shape)}")
        self.r, self.d_model, self.d_ff = rp, d_model, d_ff
        self.hidden, self.logits = torch.empty(rp), torch.empty(d_ff)
        self._k = ctypes.c_int(0)
        self._args = (self.fc1.data_ptr(), self.fc2.data_ptr(), rp, d_model, d_ff)
        self._tail = (self.thresholds.data_ptr(), self.hidden.data_ptr(), self.logits.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes


def predict_f16(p: F16Predictor, x: torch.Tensor, out_idx: torch.Tensor) -> int:
    """The neurons ``p`` selects for ``x`` (float32 [d_model]), ascending, into ``out_idx[:k]``
    (int32, contiguous, length >= d_ff); returns k. (Reference:
    ``sparse.reference.predict_active_ref``.)"""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != p.d_model:
        raise ValueError(f"x: expected contiguous float32 [{p.d_model}], got {x.dtype} "
                         f"{list(x.shape)}")
    if out_idx.dtype != torch.int32 or not out_idx.is_contiguous() or out_idx.numel() < p.d_ff:
        raise ValueError(f"out_idx: expected contiguous int32 of length >= {p.d_ff}, got "
                         f"{out_idx.dtype} {list(out_idx.shape)}")
    _check(_lib.si_predict_f16(*p._args, x.data_ptr(), *p._tail, out_idx.data_ptr(),
                               ctypes.byref(p._k)), "predict_f16")
    return p._k.value


def predict_f16_mask(p: F16Predictor, x: torch.Tensor) -> torch.Tensor:
    """The neurons ``p`` selects for each of T tokens ``x`` (float32 [T, d_model]): bool
    [T, d_ff], row t exactly the set ``predict_f16`` gives token t alone (each token's logits
    a GEMM row, its GEMV bit for bit)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or \
            x.shape[1] != p.d_model:
        raise ValueError(f"x: expected contiguous float32 [T, {p.d_model}], got {x.dtype} "
                         f"{list(x.shape)}")
    T = x.shape[0]
    mask = torch.empty(T, p.d_ff, dtype=torch.bool)
    if T == 0:
        return mask
    hidden, logits = torch.empty(T, p.r), torch.empty(T, p.d_ff)
    _check(_lib.si_predict_f16_rows(*p._args, x.data_ptr(), T, p.thresholds.data_ptr(),
                                    hidden.data_ptr(), logits.data_ptr(), mask.data_ptr()),
           "predict_f16_mask")
    return mask


# ---- one token's attention outside the C block -------------------------------------------------

_lib.si_attend_token.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_float, ctypes.c_void_p]
_attend_token = _lib.si_attend_token
_lib.si_attend_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_float, ctypes.c_void_p]
_attend_rows = _lib.si_attend_rows


def attend_token(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int,
                 cos: torch.Tensor, sin: torch.Tensor, n_heads: int, scale: float,
                 out: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """One token's attention of a plain llama block outside ``DecodeBlock`` (a sparse FFN's
    block): rope on ``qkv``'s query and key heads (float32 [(n_heads + 2 n_kv) head_dim],
    changed in place), its key and value written into the caches [n_kv_heads, max_seq,
    head_dim] (contiguous float32 or float16, both alike) at ``pos``, and softmax(scale q K) V
    of each query head over positions 0..pos into ``out`` (float32 [n_heads head_dim]).
    (Reference: ``fused.decode.attend_ref``.)"""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache: expected [n_kv_heads, max_seq, head_dim], got "
                         f"{list(k_cache.shape)}")
    nkv, max_seq, hd = k_cache.shape
    kv16 = _check_kv(k_cache, v_cache, (nkv, max_seq, hd))
    _check_f32(qkv, ((n_heads + 2 * nkv) * hd,), "qkv")
    _check_f32(out, (n_heads * hd,), "out")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_f32(t, (hd,), name)
    if not 0 <= pos < max_seq:
        raise ValueError(f"pos: expected 0 <= pos < {max_seq}, got {pos}")
    attend_token_raw(qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv16, pos,
                     cos.data_ptr(), sin.data_ptr(), n_heads, nkv, hd, max_seq, interleaved,
                     scale, out.data_ptr())
    return out


def attend_token_raw(qkv_ptr: int, k_ptr: int, v_ptr: int, kv16: bool, pos: int, cos_ptr: int,
                     sin_ptr: int, n_heads: int, n_kv_heads: int, head_dim: int, max_seq: int,
                     interleaved: bool, scale: float, out_ptr: int) -> None:
    """``attend_token`` on raw addresses, unchecked (the decode loop's path)."""
    rc = _attend_token(qkv_ptr, k_ptr, v_ptr, int(kv16), pos, cos_ptr, sin_ptr, n_heads,
                       n_kv_heads, head_dim, max_seq, int(interleaved), scale, out_ptr)
    if rc:
        _check(rc, "attend_token")


def attend_rows_raw(qkv_ptr: int, B: int, qkv_stride: int, k_ptr: int, v_ptr: int,
                    slot_bytes: int, kv16: bool, pos_ptr: int, slots_ptr: int, cos_ptr: int,
                    sin_ptr: int, n_heads: int, n_kv_heads: int, head_dim: int, max_seq: int,
                    interleaved: bool, scale: float, out_ptr: int) -> None:
    """``attend_token_raw`` for B rows in one call (a batched step's sequences): row t's qkv at
    ``qkv_ptr + t * qkv_stride`` floats, its caches ``slot_bytes`` times ``slots[t]`` (int32
    at ``slots_ptr``) past ``k_ptr``/``v_ptr``, its position ``pos[t]`` (int32 at ``pos_ptr``),
    its output row t of ``out_ptr`` [B, n_heads * head_dim]; every row's heads in one pool
    dispatch, each row's numbers those of its own ``attend_token`` call. Unchecked addresses."""
    rc = _attend_rows(qkv_ptr, B, qkv_stride, k_ptr, v_ptr, slot_bytes, int(kv16), pos_ptr,
                      slots_ptr, cos_ptr, sin_ptr, n_heads, n_kv_heads, head_dim, max_seq,
                      int(interleaved), scale, out_ptr)
    if rc:
        _check(rc, "attend_rows")


# ---- one-token llama block ------------------------------------------------------------------

ACTS = {None: 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4}  # enum in qgemv.h
_LMATS = 4  # SI_LINEAR_MATS


class _Linear(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("type", ctypes.c_int * _LMATS),
                ("w", ctypes.c_void_p * _LMATS), ("rows", ctypes.c_int64 * _LMATS),
                ("bias", ctypes.c_void_p)]


class _SparseDesc(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_void_p), ("scales", ctypes.c_void_p)] + [
        (name, ctypes.c_int) for name in ("n_mats", "block", "round_x")] + [
        ("gates", ctypes.c_void_p), ("gate_stride", ctypes.c_size_t)] + [
        (name, ctypes.c_void_p) for name in ("up_bias", "fc1", "fc2")] + [
        ("rank", ctypes.c_int), ("on_residual", ctypes.c_int)] + [
        (name, ctypes.c_void_p) for name in ("thr", "mode", "counts")] + [("q4_ups", ctypes.c_int)]


class _BlockDesc(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in (
        "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "gated", "gate_act", "up_act",
        "interleaved")] + [("eps", ctypes.c_float), ("attn_norm", ctypes.c_void_p),
                           ("ffn_norm", ctypes.c_void_p), ("qkv", _Linear), ("wo", _Linear),
                           ("w_in", _Linear), ("down", _Linear)] + [
        (name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "attn_post_norm",
                                             "ffn_post_norm")] + [
        ("window", ctypes.c_int), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("sparse", _SparseDesc), ("residual", ctypes.c_float)]


@dataclass(frozen=True)
class SparseBlockFFN:
    """A block's FFN computed neuron by neuron, for ``DecodeBlock(sparse=...)`` (qgemv.h's
    ``si_sparse_ffn``): the neuron bundles of ``sparse_ffn_i8`` (``rows`` int8, ``scales``
    given, ``block``, ``round_x``; a ReLU gate's rows apart as q4 rows: ``gates``, as there, and
    with them maybe uint8 bundles of q4 ups, ``scales`` None) or
    ``sparse_ffn_q4`` (uint8 q4 rows, ``scales`` None); the neurons each row computes chosen by
    ``predictor`` as ``predict_f16`` / ``predict_f16_mask`` choose them (None: every neuron).
    ``on_residual``: the predictor reads the residual stream, not the FFN's normed input.
    ``mode`` (int32 [1], read at each call of several rows: 0 each row its own set, 1 the union
    of the rows' sets, 2 every neuron, 3 every neuron by the dense copy) and ``counts`` (int64
    [2]: rows and neurons computed, added by each call) are numpy arrays the caller owns and may
    read or change between calls. ``w_in`` / ``down`` (with ``w_in_bias``): the same FFN as dense
    matrices (``DecodeBlock``'s, gate rows then up rows), which mode 3 computes several rows
    with; empty: none.
    (Reference: ``reference.block_decode_ref`` with the sparse FFN's reference as ``ffn``.)"""

    rows: torch.Tensor
    scales: torch.Tensor | None
    block: int
    round_x: bool
    up_bias: torch.Tensor | None
    predictor: F16Predictor | None
    on_residual: bool
    mode: np.ndarray
    counts: np.ndarray
    gates: torch.Tensor | None = None
    w_in: tuple[QuantMatrix, ...] = ()
    down: tuple[QuantMatrix, ...] = ()
    w_in_bias: torch.Tensor | None = None

    def desc(self, d_model: int, d_ff: int, gated: bool) -> _SparseDesc:
        """The checked C description (ValueError on rows the block's kernels do not take)."""
        n_mats = 3 if gated else 2
        apart = self.gates is not None
        q4u = apart and self.rows.dtype == torch.uint8  # bundles of q4 ups (dtype "q4i8")
        if apart and ((self.scales is None and not q4u) or not gated or not self.round_x):
            raise ValueError("gates: q4 gate rows apart need int8 rows (or bundles of q4 ups) of "
                             "a gated FFN with x rounded (round_x)")
        if self.scales is not None or q4u:
            x = torch.empty(1, d_model)
            _check_i8(self.rows, self.scales, self.block, gated, x, x, self.round_x, apart)
            n_mats = self.rows.shape[1] if apart else n_mats
        else:
            _check_q4_bundles(self.rows, d_model)
        if self.rows.dim() != 3 or self.rows.shape[0] != d_ff or self.rows.shape[1] != n_mats:
            raise ValueError(f"rows: expected {d_ff} bundles of {n_mats} rows, got "
                             f"{list(self.rows.shape)}")
        if self.up_bias is not None:
            _check_f32(self.up_bias, (d_ff,), "up_bias")
        if not (isinstance(self.mode, np.ndarray) and self.mode.dtype == np.int32
                and self.mode.shape == (1,)):
            raise ValueError("mode: expected a numpy int32 array [1]")
        if not (isinstance(self.counts, np.ndarray) and self.counts.dtype == np.int64
                and self.counts.shape == (2,)):
            raise ValueError("counts: expected a numpy int64 array [2]")
        p = self.predictor
        if p is not None and (p.d_model, p.d_ff) != (d_model, d_ff):
            raise ValueError(f"predictor: expected d_model {d_model}, d_ff {d_ff}, got "
                             f"{p.d_model}, {p.d_ff}")
        d = _SparseDesc(rows=self.rows.data_ptr(), n_mats=n_mats, block=self.block,
                        round_x=int(self.round_x), on_residual=int(self.on_residual),
                        mode=self.mode.ctypes.data, counts=self.counts.ctypes.data,
                        q4_ups=int(q4u))
        if self.scales is not None:
            d.scales = self.scales.data_ptr()
        if self.up_bias is not None:
            d.up_bias = self.up_bias.data_ptr()
        if apart:
            d.gates, d.gate_stride = _q4_gate_rows(self.gates, d_ff, d_model)
        if p is not None:
            d.fc1, d.fc2, d.rank, d.thr = (p.fc1.data_ptr(), p.fc2.data_ptr(), p.r,
                                           p.thresholds.data_ptr())
        return d


_lib.si_block_new.restype = ctypes.c_void_p
_lib.si_block_new.argtypes = [ctypes.POINTER(_BlockDesc), ctypes.POINTER(ctypes.c_int)]
_lib.si_block_free.argtypes = [ctypes.c_void_p]
_lib.si_block_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int]
_block_decode = _lib.si_block_decode
_lib.si_block_decode_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_block_decode_rows = _lib.si_block_decode_rows
_lib.si_stack_decode_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_stack_decode_rows = _lib.si_stack_decode_rows


class DecodeBlock:
    """A pre-norm llama block (RMSNorm, RoPE, grouped-query attention, gated or plain FFN) for
    one token, entirely in the C library: ``x += wo(attend(rope(qkv(norm(x)))))``, then ``x +=
    down(glu(w_in(norm(x))))``, the new key/value written into the caches. One call, five pool
    dispatches (the four products and the heads), no Python in between.

    ``qkv``, ``wo``, ``w_in``, ``down``: lists of ``QuantMatrix`` sharing one input, rows stacked
    (q, k, v; gate then up when ``gated``); ``biases``: optional float32 bias per weight name.
    ``gate_act``/``up_act``: names as ``models.model.ACTIVATIONS`` keys. The matrices, norm
    weights and biases are referenced, not copied (this object holds them).
    Options for Gemma 2/3 and Qwen3 blocks (None / 0: not used): ``q_norm``/``k_norm`` [head_dim]
    RMSNorm each q and k head before rope; ``attn_post_norm``/``ffn_post_norm`` [d_model]
    RMSNorm the attention and FFN outputs before their residual adds; ``window`` attends to the
    last ``window`` positions only; ``scale`` replaces 1/sqrt(head_dim) on the scores;
    ``softcap`` > 0 soft-caps them, ``cap · tanh(score / cap)`` (Gemma 2), before the softmax;
    ``residual`` multiplies the attention's and the FFN's outputs before their residual adds
    (Granite's residual_multiplier). ``d_ff`` 0 with no ``w_in``, ``down`` or
    ``ffn_post_norm``: attention only, ``x +=
    wo(attend(...))``, the caller computing the FFN (a mixture of experts; not in a
    ``DecodeStack``). (Reference: ``reference.block_decode_ref``.)"""

    def __init__(self, *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                 gated: bool, gate_act: str | None, up_act: str | None, interleaved: bool,
                 eps: float, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 qkv: Sequence[QuantMatrix], wo: Sequence[QuantMatrix],
                 w_in: Sequence[QuantMatrix], down: Sequence[QuantMatrix],
                 biases: dict[str, torch.Tensor | None] | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 attn_post_norm: torch.Tensor | None = None,
                 ffn_post_norm: torch.Tensor | None = None, window: int = 0,
                 scale: float | None = None, softcap: float = 0.0,
                 sparse: SparseBlockFFN | None = None, residual: float = 1.0):
        biases = {k: v for k, v in (biases or {}).items() if v is not None}
        if sparse is not None and (w_in or down or "w_in" in biases):
            raise ValueError("w_in, down: expected none (and no w_in bias) with a sparse FFN "
                             f"(its dense copy: sparse.w_in, sparse.down); got {len(w_in)} and "
                             f"{len(down)} matrices")
        if sparse is not None and (sparse.w_in or sparse.down):  # the sparse FFN's dense copy
            w_in, down = sparse.w_in, sparse.down
            if sparse.w_in_bias is not None:
                biases["w_in"] = sparse.w_in_bias
        if not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window: expected an int >= 0 (0: the whole cache), got {window!r}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale: expected a positive float or None, got {scale!r}")
        if not (0.0 <= softcap < math.inf):
            raise ValueError(f"softcap: expected a finite float >= 0 (0: none), got {softcap!r}")
        if not (0.0 < residual < math.inf):
            raise ValueError(f"residual: expected a finite float > 0 (1: none), got {residual!r}")
        for name in ("gate_act", "up_act"):
            act = locals()[name]
            if act not in ACTS:
                raise ValueError(f"{name}: expected one of {list(ACTS)}, got {act!r}")
        d = _BlockDesc(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                       d_ff=d_ff, gated=int(gated), gate_act=ACTS[gate_act], up_act=ACTS[up_act],
                       interleaved=int(interleaved), eps=eps, window=window,
                       scale=scale or 0.0, softcap=softcap, residual=residual)
        self.hd, self.d_model, self.nkv = head_dim, d_model, n_kv_heads
        self.sparse = sparse is not None
        self.attn_only = d_ff == 0 and sparse is None
        norms = []
        for field, w, n in (("attn_norm", attn_norm, d_model), ("ffn_norm", ffn_norm, d_model),
                            ("q_norm", q_norm, head_dim), ("k_norm", k_norm, head_dim),
                            ("attn_post_norm", attn_post_norm, d_model),
                            ("ffn_post_norm", ffn_post_norm, d_model)):
            if w is None and field not in ("attn_norm", "ffn_norm"):
                continue
            w = w.detach().float().contiguous()
            _check_f32(w, (n,), field)
            norms.append(w)
            setattr(d, field, w.data_ptr())
        self._keep: list = [norms, sparse]
        if sparse is not None:
            d.sparse = sparse.desc(d_model, d_ff, gated)
        for field, mats in (("qkv", qkv), ("wo", wo), ("w_in", w_in), ("down", down)):
            if d_ff == 0 and sparse is None and field in ("w_in", "down") and not mats:
                continue  # attention only: the caller computes the FFN
            if sparse is not None and field in ("w_in", "down") and not mats:
                b = biases.get(field)
                if b is not None:  # the sparse FFN's output bias
                    b = b.detach().float().contiguous()
                    _check_f32(b, (d_model,), f"{field} bias")
                    d.down.bias = b.data_ptr()
                self._keep.append(b)
                continue
            if not 1 <= len(mats) <= _LMATS:
                raise ValueError(f"{field}: expected 1..{_LMATS} matrices, got {len(mats)}")
            lin = getattr(d, field)
            lin.n = len(mats)
            for i, m in enumerate(mats):
                lin.type[i], lin.w[i], lin.rows[i] = m.code, m.ptr, m.rows
            b = biases.get(field)
            if b is not None:
                b = b.detach().float().contiguous()
                _check_f32(b, (sum(m.rows for m in mats),), f"{field} bias")
                lin.bias = b.data_ptr()
            self._keep.append((list(mats), b))
        err = ctypes.c_int(0)
        handle = _lib.si_block_new(ctypes.byref(d), ctypes.byref(err))
        if not handle:
            shapes = {f: [(m.rows, m.cols) for m in ms]
                      for f, ms in (("qkv", qkv), ("wo", wo), ("w_in", w_in), ("down", down))}
            raise ValueError(f"block: expected q/k/v rows {(n_heads + 2 * n_kv_heads) * head_dim}"
                             f", wo {d_model}x{n_heads * head_dim}, w_in "
                             f"{(2 if gated else 1) * d_ff}x{d_model}, down {d_model}x{d_ff}; got "
                             f"{shapes} ({_ERRORS.get(err.value, err.value)})")
        self._handle = handle
        self._free = _lib.si_block_free

    def __del__(self):
        h = getattr(self, "_handle", None)
        if h:
            self._free(h)
            self._handle = None

    def run(self, x_ptr: int, pos: int, k_ptr: int, v_ptr: int, cos_ptr: int, sin_ptr: int,
            max_seq: int, kv16: bool = False) -> None:
        """``__call__`` on raw addresses, unchecked (the decode loop's path); ``kv16``: the
        caches hold float16."""
        rc = _block_decode(self._handle, x_ptr, pos, k_ptr, v_ptr, int(kv16), cos_ptr, sin_ptr,
                           max_seq)
        if rc:
            _check(rc, "block_decode")

    def run_rows(self, x_ptr: int, B: int, pos_ptr: int, slots_ptr: int, k_ptr: int, v_ptr: int,
                 slot_stride: int, cos_ptr: int, sin_ptr: int, max_seq: int,
                 kv16: bool = False) -> None:
        """``rows`` on raw addresses, unchecked (the batched decode step's path)."""
        rc = _block_decode_rows(self._handle, x_ptr, B, pos_ptr, slots_ptr, k_ptr, v_ptr,
                                int(kv16), slot_stride, cos_ptr, sin_ptr, max_seq)
        if rc:
            _check(rc, "block_decode_rows")

    def rows(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences (continuous batching): ``x`` float32 [B, d_model],
        updated in place and returned; row i is the sequence in cache slot ``slots[i]`` at
        ``positions[i]`` (int32 [B]); caches [slots, n_kv_heads, max_seq, head_dim]; ``cos``/
        ``sin`` the rope tables [>= max_seq, head_dim]. Each row's numbers equal a one-row call's
        (the weights are read once for all rows)."""
        B = _check_rows_x(x, self.d_model)
        n_slots, max_seq = (k_cache.shape[0], k_cache.shape[2]) if k_cache.dim() == 4 else (0, 0)
        kv16 = _check_kv(k_cache, v_cache, (n_slots, self.nkv, max_seq, self.hd))
        for name, t in (("cos", cos), ("sin", sin)):
            _check_rope(t, name, self.hd, max_seq)
        _check_rows_at(positions, slots, B, max_seq, n_slots)
        self.run_rows(x.data_ptr(), B, positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                      v_cache.data_ptr(), k_cache.stride(0), cos.data_ptr(), sin.data_ptr(),
                      max_seq, kv16)
        return x

    def __call__(self, x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` float32 [d_model], updated in place and returned; caches [n_kv_heads, max_seq,
        head_dim] (contiguous float32 or float16, both alike; the new key/value written at
        ``pos``); ``cos``/``sin`` the rope row of ``pos`` [head_dim]."""
        _check_f32(x, (self.d_model,), "x")
        max_seq = k_cache.shape[1] if k_cache.dim() == 3 else 0
        kv16 = _check_kv(k_cache, v_cache, (self.nkv, max_seq, self.hd))
        for name, t in (("cos", cos), ("sin", sin)):
            _check_f32(t, (self.hd,), name)
        if not 0 <= pos < max_seq:
            raise ValueError(f"pos: expected 0 <= pos < {max_seq}, got {pos}")
        self.run(x.data_ptr(), pos, k_cache.data_ptr(), v_cache.data_ptr(), cos.data_ptr(),
                 sin.data_ptr(), max_seq, kv16)
        return x


class DecodeStack:
    """A model's ``DecodeBlock`` s in order, run over one decode step in one call: every block on
    the same B rows (``DecodeBlock.rows``; B = 1 with slot 0 is a single sequence's token), each
    block with its own layer of the KV cache and its own rope tables. The same numbers as calling
    the blocks one by one, without a Python call (and a lock) per block."""

    def __init__(self, blocks: Sequence[DecodeBlock]):
        if not blocks:
            raise ValueError("blocks: expected at least one DecodeBlock")
        self.blocks = list(blocks)  # held: the handles must outlive this object
        self.n = len(self.blocks)
        self.d_model, self.hd, self.nkv = blocks[0].d_model, blocks[0].hd, blocks[0].nkv
        if any((b.d_model, b.hd, b.nkv) != (self.d_model, self.hd, self.nkv) for b in blocks):
            raise ValueError("blocks: expected one d_model, head_dim and kv-head count for all")
        if any(b.attn_only for b in blocks):
            raise ValueError("blocks: expected whole blocks, found attention-only ones (d_ff 0: "
                             "their FFN is the caller's)")
        self._handles = (ctypes.c_void_p * self.n)(*[b._handle for b in self.blocks])

    def rope_tables(self, tables: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        """Per-block (cos, sin) tables [positions, head_dim] as the address arrays ``run`` takes
        (kept with this object: build once per set of tables)."""
        if len(tables) != self.n:
            raise ValueError(f"rope tables: expected {self.n} (one per block), got {len(tables)}")
        for cos, sin in tables:
            _check_rope(cos, "cos", self.hd)
            _check_rope(sin, "sin", self.hd)
        keep = [t for pair in tables for t in pair]
        cos_a = (ctypes.c_void_p * self.n)(*[c.data_ptr() for c, _ in tables])
        sin_a = (ctypes.c_void_p * self.n)(*[s.data_ptr() for _, s in tables])
        return keep, cos_a, sin_a, min(c.shape[0] for c, _ in tables)

    def run(self, x_ptr: int, B: int, pos_ptr: int, slots_ptr: int, k_ptr: int, v_ptr: int,
            layer_stride: int, slot_stride: int, ropes, max_seq: int, kv16: bool = False) -> None:
        """Every block over B rows at raw addresses, unchecked (the decode step's path); ``ropes``
        from ``rope_tables``; ``k_ptr``/``v_ptr`` the caches' first layer, slot 0 (strides in
        values; float16 caches when ``kv16``)."""
        _, cos_a, sin_a, _ = ropes
        rc = _stack_decode_rows(self._handles, self.n, x_ptr, B, pos_ptr, slots_ptr, k_ptr, v_ptr,
                                int(kv16), layer_stride, slot_stride, cos_a, sin_a, max_seq)
        if rc:
            _check(rc, "stack_decode_rows")

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``x`` float32 [B, d_model] through every block, updated in place and returned; caches
        [n_blocks, slots, n_kv_heads, max_seq, head_dim]; ``positions``/``slots`` int32 [B] as
        ``DecodeBlock.rows``; ``tables``: one (cos, sin) per block."""
        B = _check_rows_x(x, self.d_model)
        shape = tuple(k_cache.shape)
        if len(shape) != 5 or shape[0] != self.n:
            raise ValueError(f"k_cache: expected [{self.n}, slots, {self.nkv}, max_seq, {self.hd}]"
                             f", got {list(shape)}")
        kv16 = _check_kv(k_cache, v_cache, shape)
        max_seq, n_slots = shape[3], shape[1]
        ropes = self.rope_tables(tables)
        if ropes[3] < max_seq:
            raise ValueError(f"rope tables: expected at least {max_seq} positions, got {ropes[3]}")
        _check_rows_at(positions, slots, B, max_seq, n_slots)
        self.run(x.data_ptr(), B, positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), ropes, max_seq, kv16)
        return x
