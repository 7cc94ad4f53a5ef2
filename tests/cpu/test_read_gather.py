"""sparseinfer.cpu.read_gather (the benchmarks' read probe of the sparse kernels' pattern) reads
every byte it is asked to and nothing else: its sum against numpy's over the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu


def want(buf: torch.Tensor, stride: int, nbytes: int, idx: torch.Tensor) -> int:
    """Wrapping sum of the 64-bit words of bytes [0, nbytes) of each row idx[i]."""
    raw = buf.numpy().view(np.uint8)
    rows = [raw[i * stride:i * stride + nbytes].view(np.uint64) for i in idx.tolist()]
    with np.errstate(over="ignore"):
        return int(np.sum([r.sum(dtype=np.uint64) for r in rows], dtype=np.uint64)) if rows else 0


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 37, 300])
@pytest.mark.parametrize("stride,nbytes", [(6912, 6912), (6912, 3456), (1000, 8), (4104, 4096)])
def test_sum_matches_numpy(threads, k, stride, nbytes):
    g = torch.Generator().manual_seed(k + stride + nbytes)
    n_rows = 400
    buf = torch.randint(0, 256, (n_rows * stride,), dtype=torch.uint8, generator=g)
    idx = torch.sort(torch.randperm(n_rows, generator=g)[:k])[0].to(torch.int32)
    assert cpu.read_gather(buf, stride, nbytes, idx) == want(buf, stride, nbytes, idx)


def test_repeated_rows_in_any_order_are_each_read(threads):
    buf = torch.arange(64 * 16, dtype=torch.int64).view(torch.uint8)  # 16 rows of 64 bytes
    idx = torch.tensor([5, 5, 2, 15, 0], dtype=torch.int32)
    assert cpu.read_gather(buf, 64, 64, idx) == want(buf, 64, 64, idx)


@pytest.mark.parametrize("stride,nbytes,rows,match", [
    (64, 12, [0], "multiples of 8"),
    (60, 8, [0], "multiples of 8"),
    (64, 72, [0], "nbytes <= stride"),
    (64, 64, [16], "rows 0..15"),
    (64, 64, [-1], "rows 0..15"),
])
def test_bad_arguments_say_what_was_expected(stride, nbytes, rows, match):
    buf = torch.zeros(64 * 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        cpu.read_gather(buf, stride, nbytes, torch.tensor(rows, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        cpu.read_gather(buf, 64, 64, torch.tensor([0]))
