"""cpu.read_runs (the disk tier's reads in C) against the file's bytes sliced by numpy."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from sparseinfer import cpu


def _runs(rng, size: int, stride: int, n: int):
    """n runs of whole rows at random offsets, each with a random subset of its rows wanted."""
    start, length, first, pick = [], [], [0], []
    for _ in range(n):
        rows = int(rng.integers(1, 9))
        s = int(rng.integers(0, (size - rows * stride) // 7)) * 7  # any offset, not aligned
        want = np.sort(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False))
        start.append(s)
        length.append(rows * stride)
        pick += want.tolist()
        first.append(len(pick))
    return (np.array(start), np.array(length), np.array(first), np.array(pick))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "rows.bin"
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_rows_equal_the_files_bytes(data_file, direct, threads):
    path, data = data_file
    stride, row = 1000, 990
    rng = np.random.default_rng(threads)
    start, length, first, pick = _runs(rng, data.size, stride, 40)
    dest = rng.permutation(len(pick))
    out = np.zeros((len(pick), row), dtype=np.uint8)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        pytest.skip("O_DIRECT refused here (tmpfs)")
    try:
        nbytes, reads, align, fail = cpu.read_runs(fd, start, length, first, pick, dest, stride,
                                                   out, 512 if direct else 1, threads, not direct)
    finally:
        os.close(fd)
    assert fail is None and reads == 40 and align in ((512, 4096) if direct else (1,))
    assert nbytes >= length.sum()
    for i in range(40):
        for j in range(first[i], first[i + 1]):
            at = start[i] + pick[j] * stride
            np.testing.assert_array_equal(out[dest[j]], data[at:at + row])


def test_short_read_and_errno_are_reported(data_file, tmp_path):
    path, data = data_file
    stride = 512
    start, length = np.array([0, data.size - 1024]), np.array([1024, 2048])  # run 1 past the end
    first, pick = np.array([0, 2, 4]), np.array([0, 1, 0, 3])
    out = np.zeros((4, stride), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _, _, _, fail = cpu.read_runs(fd, start, length, first, pick, np.arange(4), stride, out,
                                      1, 1, False)
    finally:
        os.close(fd)
    assert fail == (1, 0, 1024)  # run 1, a short read (errno 0), 1024 bytes got
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: pread fails with EISDIR
    try:
        _, reads, _, fail = cpu.read_runs(fd, start[:1], length[:1], first[:2], pick[:2],
                                          np.arange(2), stride, out, 1, 2, False)
    finally:
        os.close(fd)
    assert fail == (0, errno.EISDIR, 0) and reads == 0


def test_bad_arguments_say_what_was_expected(data_file):
    out = np.zeros((2, 8), dtype=np.uint8)
    one = np.array([0])
    with pytest.raises(ValueError, match="one dest per pick"):
        cpu.read_runs(0, one, np.array([16]), np.array([0, 2]), np.array([0, 1]), one, 8, out,
                      1, 1, False)
    with pytest.raises(ValueError, match="dest: expected rows of out"):
        cpu.read_runs(0, one, np.array([16]), np.array([0, 1]), one, np.array([2]), 8, out, 1,
                      1, False)
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        cpu.read_runs(0, one, np.array([16]), np.array([0, 1]), one, one, 8, out.T, 1, 1, False)
    with pytest.raises(RuntimeError, match="invalid argument"):  # a pick past its run
        cpu.read_runs(0, one, np.array([16]), np.array([0, 1]), np.array([2]), one, 8, out, 1,
                      1, False)
