"""Reading neuron bundles from the file: several reads in flight, past the page cache.

``NeuronReader.submit(layer, neurons, part)`` groups the neurons into runs of neighbouring file
rows of one of the layer's neuron tensors (``part``: ``bundle``, or ``gate`` when the file keeps
the gate rows apart; the file may hold a layer's neurons in any order: ``layout.py``),
reads each run with one ``pread`` into a page-aligned buffer (``O_DIRECT``: the file's pages
never enter the page cache, so a memory budget that counts the cache holds), ``threads`` reads in
flight, and returns a ``ReadBatch`` whose ``wait()`` gives the rows. The reads and the copies of
their wanted rows run in the C library (``cpu.read_runs``: one call per batch on a helper thread,
its own threads reading, no Python and no GIL per read); without the library, or with a ``pread``
of a test's, the same runs go through ``os.preadv`` on a pool of Python threads. Any ``OSError``
or a short read becomes one ``DiskReadError`` naming the file, the offset and the bytes expected
and found: rows that were not read in full are never handed to the kernels.

Where ``O_DIRECT`` is refused (tmpfs, some overlay file systems) the reader falls back to plain
reads followed by ``posix_fadvise(DONTNEED)`` over the range read, and says so in the log.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import SparseInferError
from .layout import BundleLayout, Part

log = logging.getLogger(__name__)

ALIGN = 4096  # buffer alignment (and the widest offset alignment) for O_DIRECT
SECTOR = 512  # offset and length alignment tried first (a disk's logical block size)
MAX_RUN = 64  # neurons per read at most (a run of neighbours is one read up to this)
DEFAULT_GAP = 2  # unwanted rows a read passes over when the disk is not measured


class DiskReadError(SparseInferError):
    """A neuron bundle could not be read in full from the model file."""


def drop_file_cache(path, offset: int, length: int) -> None:
    """Ask the kernel to drop ``[offset, offset + length)`` of ``path`` from the page cache
    (best effort)."""
    if length <= 0 or not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


class AlignedBuffer:
    """Page-aligned anonymous memory (an ``mmap``) with a numpy view."""

    def __init__(self, nbytes: int):
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self.map = mmap.mmap(-1, self.nbytes)
        self.array = np.frombuffer(self.map, dtype=np.uint8)


Pread = Callable[[int, list, int], int]  # (fd, buffers, offset) -> bytes read: os.preadv


class ReadBatch:
    """Reads in flight for one layer's neurons; ``wait()`` returns their rows ``[k, part
    bytes]`` (uint8, in the order of ``neurons``) or raises ``DiskReadError``."""

    def __init__(self, neurons: np.ndarray, rows: np.ndarray, futures: list[Future],
                 part: Part):
        self.neurons, self._rows, self._futures, self.part = neurons, rows, futures, part

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> np.ndarray:
        for f in self._futures:
            f.result()  # re-raises the worker's DiskReadError
        return self._rows


class NeuronReader:
    """Reads bundles of ``layout``'s file with ``threads`` reads in flight."""

    def __init__(self, layout: BundleLayout, threads: int = 8, direct: bool = True,
                 pread: Pread | None = None, max_gap: int = 0):
        self.layout = layout
        # unwanted rows a read may pass over (rows of the bundle part: as many bytes in others)
        self.max_gap = max(0, int(max_gap))
        self.path = str(layout.path)
        self.direct = False
        flags = os.O_RDONLY
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                log.warning("%s: O_DIRECT refused (%s): plain reads, page cache dropped after "
                            "each", self.path, e.strerror or e)
        if not self.direct:
            self.fd = os.open(self.path, flags)
        self._pread = pread or os.preadv
        self._c = None  # cpu.read_runs once looked up, False when not available
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                        thread_name_prefix="sparseinfer-disk")
        self.threads = max(1, threads)
        self.sector = SECTOR  # widened to ALIGN if the device refuses SECTOR-aligned reads
        self._local = threading.local()
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()
        if self.direct and any(p.stride % 512 or any(o % 512 for o in p.offsets)
                               for p in layout.parts.values()):
            log.info("%s: bundles not 512-byte aligned: reads widened to aligned ranges",
                     self.path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _runs(self, layer: int, neurons: np.ndarray, part: Part) -> list[tuple]:
        """``_run_arrays`` run by run for the Python reads: (file offset, bytes, which rows of
        them are wanted (None: all), where they go in ``neurons``' order)."""
        arrays = self._run_arrays(layer, neurons, part)
        if arrays is None:
            return []
        start, length, first, pick, dest = arrays
        runs = []
        for i in range(len(start)):
            a, b = int(first[i]), int(first[i + 1])
            whole = int(length[i]) == (b - a) * part.stride
            runs.append((int(start[i]), int(length[i]), None if whole else pick[a:b], dest[a:b]))
        return runs

    def submit(self, layer: int, neurons: np.ndarray, part: str = "bundle") -> ReadBatch:
        """Start reading ``neurons`` (distinct; ascending unless the file's rows are in another
        order) of ``layer``'s tensor ``part`` (``BundleLayout.parts``); returns at once."""
        p = self.layout.parts[part]
        neurons = np.asarray(neurons, dtype=np.int64)
        rows = np.empty((neurons.size, p.nbytes), dtype=np.uint8)
        if self._c_reads():
            args = self._run_arrays(layer, neurons, p)
            if args is None:
                return ReadBatch(neurons, rows, [], p)
            return ReadBatch(neurons, rows, [self._pool.submit(self._read_c, layer, args, rows,
                                                               p)], p)
        runs = self._runs(layer, neurons, p)
        if not runs:
            return ReadBatch(neurons, rows, [], p)
        # one task per worker, each a share of the runs (few Python calls per read)
        n_tasks = min(self.threads, len(runs))
        tasks = [runs[k::n_tasks] for k in range(n_tasks)]
        futures = [self._pool.submit(self._read_runs, layer, t, rows, p) for t in tasks]
        return ReadBatch(neurons, rows, futures, p)

    def _c_reads(self) -> bool:
        """Whether reads go through the C library (``cpu.read_runs``: no Python and no GIL per
        read); not when a test has put its own ``pread`` in, nor without the library."""
        if self._pread is not os.preadv:
            return False
        if self._c is None:
            try:
                from .. import cpu

                self._c = cpu.read_runs
            except SparseInferError as e:  # no library, or this CPU lacks what it needs
                log.info("%s: reads in Python (%s)", self.path, e)
                self._c = False
        return bool(self._c)

    def measure_gap(self, seconds: float = 0.5, longest: int = 8) -> int:
        """How many unwanted rows a read should pass over on this disk rather than start
        another read: random reads of the file's own rows, ``self.threads`` in flight, of one
        row and of ``1 + longest`` rows, ``seconds`` each (two blocks each, alternated). One more
        row in a read costs (t_long - t_one) / longest, a read's own cost is t_one less a row;
        up to their ratio less one row (at most ``longest``) are passed over. A fast SSD's
        answer is several rows, a slow or throttled disk's 0 (benchmarks/RESULTS.md).
        ``DEFAULT_GAP`` without O_DIRECT (the page cache would answer) or without the C reads."""
        if not (self.direct and self._c_reads()):
            return DEFAULT_GAP
        lay, p = self.layout, self.layout.parts["bundle"]
        longest = max(1, min(longest, lay.d_ff - 1))
        rng = np.random.default_rng()
        k = 4 * self.threads  # reads per call
        out = np.empty((k, p.nbytes), dtype=np.uint8)
        first, pick, dest = np.arange(k + 1), np.zeros(k, dtype=np.int32), np.arange(k)
        offsets = np.asarray(p.offsets)
        lengths = {span: np.full(k, span * p.stride) for span in (1, 1 + longest)}

        def call(span: int) -> tuple[float, int]:
            layers = rng.integers(0, len(offsets), k)
            rows = rng.integers(0, lay.d_ff - span + 1, k)
            start = offsets[layers] + rows * p.stride
            t0 = time.perf_counter()
            _, n, _, failure = self._c(self.fd, start, lengths[span], first, pick, dest,
                                       p.stride, out, self.sector, self.threads, False)
            if failure is not None:
                raise DiskReadError(f"{self.path}: measuring the disk: a read failed "
                                    f"(errno {failure[1]})")
            return time.perf_counter() - t0, n

        # each kind in two blocks of seconds / 2, alternated (short, long, short, long): a
        # block is long enough that what a throttle or a drift does at its edges is small
        spent, reads = [0.0, 0.0], [0, 0]
        try:
            for kind in (0, 1, 0, 1):
                t_end = time.perf_counter() + seconds / 2
                while time.perf_counter() < t_end:
                    dt, n = call(1 + kind * longest)
                    spent[kind] += dt
                    reads[kind] += n
        except DiskReadError as e:  # the run's own reads will say what is wrong
            log.warning("%s: using read gap %d", e, DEFAULT_GAP)
            return DEFAULT_GAP
        t_one, t_long = spent[0] / reads[0], spent[1] / reads[1]
        row = max(t_long - t_one, 0.0) / longest
        read = max(t_one - row, 0.0)
        # one row short of the break-even: on a throttled disk the break-even gap read fewer
        # tokens a second than none (benchmarks/RESULTS.md)
        gap = longest if row <= 0.0 else int(min(longest, max(0.0, read / row - 1.0)))
        log.info("%s: a read costs %.1f µs and each row in it %.1f µs (%d in flight): reads "
                 "pass over up to %d unwanted rows", self.path, read * 1e6, row * 1e6,
                 self.threads, gap)
        return gap

    def _run_arrays(self, layer: int, neurons: np.ndarray, part: Part):
        """The reads of ``neurons`` (None for none) as ``cpu.read_runs`` takes them: start and
        length of each read in the file; first[i]..first[i + 1] its wanted rows, each at row
        ``pick`` of the read and going to row ``dest`` of ``neurons``' order. A read is a run of
        neighbouring file rows, gaps of up to ``max_gap`` unwanted rows read through (one longer
        read costs less than two), at most ``MAX_RUN`` rows."""
        if neurons.size == 0:
            return None
        lay = self.layout
        rows = lay.row_of(layer, neurons)
        where = None
        if lay.positions is not None:
            where = np.argsort(rows, kind="stable")
            rows = rows[where]
        gap = self.max_gap * lay.stride // part.stride  # as many bytes as in the bundle part
        r, n, step = rows.tolist(), len(rows), gap + 1
        heads, a = [], 0
        while a < n:
            # the furthest b with r[b-1] within MAX_RUN rows of r[a] and no gap over the gap
            b = a + 1
            while b < n and r[b] - r[b - 1] <= step and r[b] - r[a] < MAX_RUN:
                b += 1
            heads.append(a)
            a = b
        first = np.array(heads + [n], dtype=np.int64)
        run_row = rows[first[:-1]]
        span = rows[first[1:] - 1] - run_row + 1
        start = part.offsets[layer] + run_row * part.stride
        pick = rows - np.repeat(run_row, np.diff(first))
        dest = np.arange(n) if where is None else where
        return start, span * part.stride, first, pick, dest

    def _read_c(self, layer: int, args, rows: np.ndarray, part: Part) -> None:
        start, length, first, pick, dest = args
        nbytes, reads, align, failure = self._c(
            self.fd, start, length, first, pick, dest, part.stride, rows,
            self.sector if self.direct else 1, self.threads, not self.direct)
        if self.direct and align != self.sector:
            log.info("%s: %d-byte aligned O_DIRECT reads refused: using %d", self.path,
                     self.sector, align)
            self.sector = align
        with self._lock:
            self.bytes_read += nbytes
            self.reads += reads
        if failure is not None:
            i, err, got = failure
            a = align if self.direct else 1
            raise self._error(layer, part, int(start[i]), int(length[i]),
                              int(start[i]) // a * a, got, os.strerror(err) if err else None)

    def _error(self, layer: int, part: Part, start: int, length: int, lo: int, got: int,
               failed: str | None) -> DiskReadError:
        """The one error of the read of file bytes [start, start + length) of ``layer``'s rows
        of ``part`` (from the aligned offset ``lo``): it ``failed`` (the system's message), or
        got only ``got`` bytes."""
        end = start + length
        row = (start - part.offsets[layer]) // part.stride
        what = "" if part.name == "bundle" else f" ({part.name} rows)"
        rows = f"layer {layer} file rows {row}..{row + length // part.stride - 1}{what}"
        if failed is not None:
            return DiskReadError(f"{self.path}: reading {rows} (bytes {start}..{end}) failed: "
                                 f"{failed}")
        return DiskReadError(f"{self.path}: short read of {rows}: expected {end - lo} bytes at "
                             f"offset {lo}, got {got} (truncated file?)")

    def read(self, layer: int, neurons: np.ndarray, part: str = "bundle") -> np.ndarray:
        return self.submit(layer, neurons, part).wait()

    def _buffer(self, nbytes: int) -> AlignedBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = AlignedBuffer(max(nbytes, MAX_RUN * self.layout.stride
                                                      + 2 * ALIGN))
        return buf

    def _read_runs(self, layer: int, runs, rows: np.ndarray, part: Part) -> None:
        for start, length, picks, dest in runs:
            a = self.sector if self.direct else 1
            lo, hi = start // a * a, -(-(start + length) // a) * a
            buf = self._buffer(hi - lo + ALIGN)
            view = memoryview(buf.map)[: hi - lo]
            try:
                try:
                    got = self._pread(self.fd, [view], lo)
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL and self.sector < ALIGN):
                        raise
                    log.info("%s: %d-byte aligned O_DIRECT reads refused: using %d", self.path,
                             self.sector, ALIGN)
                    self.sector = ALIGN
                    view.release()
                    lo, hi = start // ALIGN * ALIGN, -(-(start + length) // ALIGN) * ALIGN
                    buf = self._buffer(hi - lo + ALIGN)
                    view = memoryview(buf.map)[: hi - lo]
                    got = self._pread(self.fd, [view], lo)
            except OSError as e:
                raise self._error(layer, part, start, length, lo, 0,
                                  str(e.strerror or e)) from None
            finally:
                view.release()
            if got < start + length - lo:
                raise self._error(layer, part, start, length, lo, got, None)
            blk = buf.array[start - lo: start - lo + length].reshape(-1, part.stride)
            rows[dest] = (blk if picks is None else blk[picks])[:, :part.nbytes]
            if not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_read += hi - lo
                self.reads += 1
