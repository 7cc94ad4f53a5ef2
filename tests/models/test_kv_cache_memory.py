"""The KV cache's pages are mapped as positions are written (``fileio.lazy_zeros``): preallocating
a long context costs the memory of the positions used, by the system's own count (the resident
set in /proc/self/statm), and reads zeros everywhere else."""

from __future__ import annotations

import sys

import pytest
import torch

from sparseinfer.config import ModelConfig
from sparseinfer.fileio import PAGE, lazy_zeros
from sparseinfer.models.model import KVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc/self/statm")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


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
    before = _rss()
    cache = KVCache(cfg, 1, 8192, torch.float16)  # 2 x 64 MiB
    allocated = _rss() - before
    assert cache.nbytes == 2 * 8 * 8 * 8192 * 64 * 2
    assert allocated < cache.nbytes / 16, allocated
    cache.k[:, :, :, :16] = 1.0  # 16 positions: 16 x 128 bytes of each of 64 head rows
    cache.v[:, :, :, :16] = 1.0
    used = _rss() - before
    assert used < cache.nbytes / 16, used  # a page per head row, not the whole cache
    assert float(cache.k[:, :, :, 16:].float().abs().sum()) == 0.0  # unwritten: zeros
