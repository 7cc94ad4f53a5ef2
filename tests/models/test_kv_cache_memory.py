"""The KV cache's pages are mapped as positions are written (``fileio.lazy_zeros``): preallocating
a long context costs the memory of the positions used, by the system's own count (``mincore``:
which pages of the cache's own memory are resident; the process's resident set would also count
whatever another thread of the test session allocates meanwhile), and reads zeros everywhere
else."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest
import torch

from sparseinfer.config import ModelConfig
from sparseinfer.fileio import PAGE, lazy_zeros
from sparseinfer.models.model import KVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs mincore(2)")


def _resident(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages that are resident (mincore over the whole pages it spans)."""
    lo = t.data_ptr() // PAGE * PAGE
    n = (t.data_ptr() + t.numel() * t.element_size() - lo + PAGE - 1) // PAGE
    vec = np.zeros(n, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * PAGE),
                        vec.ctypes.data_as(ctypes.c_void_p)) == 0, ctypes.get_errno()
    return int((vec & 1).sum()) * PAGE


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_lazy_zeros_are_zeros_of_the_shape_asked(dtype):
    t = lazy_zeros((3, 5, 7), dtype)
    assert t.dtype == dtype and tuple(t.shape) == (3, 5, 7) and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    t[1, 2, 3] = 4
    assert float(t.sum()) == 4.0


@linux
def test_a_long_context_costs_the_positions_used():
    cfg = ModelConfig(arch="llama", d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1024,
                      vocab_size=100, max_seq_len=8192)
    cache = KVCache(cfg, 1, 8192, torch.float16)  # 2 x 64 MiB
    assert cache.nbytes == 2 * 8 * 8 * 8192 * 64 * 2
    allocated = _resident(cache.k) + _resident(cache.v)
    assert allocated <= 2 * PAGE, allocated  # (a page the allocator's header may share)
    cache.k[:, :, :, :16] = 1.0  # 16 positions: 16 x 128 bytes of each of 64 head rows
    cache.v[:, :, :, :16] = 1.0
    used = _resident(cache.k) + _resident(cache.v)
    assert 2 * 64 * PAGE <= used <= 2 * 2 * 64 * PAGE, used  # a page or two per head row
    assert float(cache.k[:, :, :, 16:].float().abs().sum()) == 0.0  # unwritten: zeros


_RAISED_THRESHOLD = """
import ctypes, numpy as np, torch
from sparseinfer.fileio import lazy_zeros
libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 512 * 2**20) == 1  # M_MMAP_THRESHOLD: large callocs come from the heap
for _ in range(3):  # heap memory used and freed, which calloc must clear when it hands it back
    x = np.ones(160 * 2**20, np.uint8); del x
t = lazy_zeros((64 * 2**20 // 2,), torch.float16)
page = 4096
vec = np.zeros(t.numel() * 2 // page, np.uint8)
assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(vec.size * page),
                    vec.ctypes.data_as(ctypes.c_void_p)) == 0
print(int((vec & 1).sum()))
"""


@linux
def test_zeros_stay_unmapped_whatever_the_allocator():
    """The cache's zeros are a mapping of their own: with glibc's mmap threshold raised above
    their size (so calloc serves them from a heap it must clear), none of their pages is
    resident before a write. In a subprocess: the allocator setting is process-wide."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _RAISED_THRESHOLD], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 0
