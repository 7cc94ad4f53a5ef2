"""Reading the small files the loaders and offline steps hand each other, with one kind of error
message; and the memory-map helpers (``madvise`` through ``libc``, available memory)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from .errors import SparseInferError


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz (no pickles); ``what`` names the expected file in errors,
    e.g. "a placement .npz written by save_placement"."""
    path = Path(path)
    kind = what.split(" .npz")[0]
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise SparseInferError(f"{path}: expected {kind} file, found no such file") from None
    except (OSError, ValueError) as e:
        raise SparseInferError(f"{path}: expected {what}, found: {e}") from None


def read_json(path: Path, error: type[SparseInferError] = SparseInferError) -> Any:
    """The parsed JSON of ``path``; invalid JSON or text raises ``error`` naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON: {e}") from None


@functools.lru_cache(maxsize=None)
def libc():
    """The C library (for ``madvise``), or None where it cannot be loaded (not Linux/glibc)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def release_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``): a load's
    temporaries (float copies, quantizer buffers) otherwise stay in the process's resident set
    after they are freed. Best effort; nothing elsewhere."""
    lib = libc()
    trim = getattr(lib, "malloc_trim", None) if lib is not None else None
    if trim is not None:
        trim(0)


_MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def drop_pages(arr: np.ndarray) -> None:
    """Tell the kernel this process no longer needs the mapped pages under ``arr`` (a view of a
    read-only file map): they leave the resident set (and stay in the page cache). Best effort;
    whole pages inside the array only."""
    import ctypes

    lib = libc()
    if lib is None or arr.size == 0:
        return
    start = arr.__array_interface__["data"][0]
    end = start + arr.nbytes
    lo = -(-start // PAGE) * PAGE
    hi = end // PAGE * PAGE
    if hi > lo:
        lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


_MADV_RANDOM = 1


def advise_random(addr: int, nbytes: int) -> bool:
    """``madvise(MADV_RANDOM)`` over the whole pages of ``[addr, addr + nbytes)`` (a read-only
    file map): page faults there read their own page only, no read-around. Best effort: False
    where it could not be done."""
    import ctypes

    lib = libc()
    lo = addr // PAGE * PAGE
    if lib is None or nbytes <= 0:
        return False
    return lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(addr + nbytes - lo),
                       _MADV_RANDOM) == 0


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros (page-aligned) whose pages the system maps only when first written:
    an anonymous mapping of its own (not ``torch.zeros``, which writes every byte, nor calloc,
    which may hand back heap memory it must clear when the allocator's mmap threshold has moved),
    in 4 KiB pages (``MADV_NOHUGEPAGE``: a first write would otherwise map and clear 2 MiB). A KV
    cache preallocated for a long context then costs memory and first-touch time for the
    positions used, not for all of them. Where anonymous mappings are not offered (Windows):
    ``torch.zeros``."""
    import math
    import mmap

    import torch

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    anon = getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes == 0 or anon is None:
        return torch.zeros(shape, dtype=dtype)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | anon)
    if nbytes >= 2**21 and hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapped.madvise(mmap.MADV_NOHUGEPAGE)
    # the array (and so the tensor) holds the mapping; it is unmapped when they are gone
    return torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8)).view(dtype).view(shape)


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, or less under a cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_room()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail if avail is not None else 1 << 62


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v1 or v2), counting reclaimable
    file cache as free; None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        try:
            limit = (base / files[0]).read_text().strip()
            usage = int((base / files[1]).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        cache = 0
        try:
            for stat in (base / "memory.stat").read_text().splitlines():
                k, v = stat.split()
                if k == files[2]:
                    cache = int(v)
        except (OSError, ValueError):
            pass
        return int(limit) - usage + cache
    return None
