"""Benchmark helpers shared by ``benchmarks/*.py`` and ``sparseinfer bench``.

``measure_read_bandwidth`` is the physical floor every decode benchmark is judged against: a
token has to read the weights it uses at least once, so bytes / bandwidth is the best time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numba
import numpy as np
from numba import njit, prange

log = logging.getLogger(__name__)


@njit(fastmath=True, cache=True)
def _sum4(a: np.ndarray, start: int, end: int) -> float:
    """Sum of a[start:end] read as 4 concurrent streams (one per quarter), like a kernel that
    walks 4 rows at a time: one stream per core leaves bandwidth unused on these CPUs."""
    q = (end - start) // 4
    b0 = a[start : start + q]
    b1 = a[start + q : start + 2 * q]
    b2 = a[start + 2 * q : start + 3 * q]
    b3 = a[start + 3 * q : start + 4 * q]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for j in range(q):  # from 0 over slices: no negative-index wraparound, so it vectorises
        s0 += b0[j]
        s1 += b1[j]
        s2 += b2[j]
        s3 += b3[j]
    tail = a[start + 4 * q : end]
    for j in range(tail.shape[0]):
        s0 += tail[j]
    return s0 + s1 + s2 + s3


@njit(parallel=True, cache=True)
def _parallel_sum(a: np.ndarray, n_chunks: int) -> float:
    # The loop body is its own function: numba does not apply fastmath inside a prange body, and
    # without reassociation the sum is one dependency chain (~3 GB/s instead of streaming).
    n = a.shape[0]
    per = (n + n_chunks - 1) // n_chunks
    parts = np.zeros(n_chunks, np.float32)
    for t in prange(n_chunks):
        parts[t] = _sum4(a, t * per, min(n, (t + 1) * per))
    return parts.sum()


def measure_read_bandwidth(threads: int, nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth (GB/s, 1e9 B/s) of a ``threads``-thread streaming sum
    (each thread reads its part as 4 concurrent streams)."""
    if threads < 1:
        raise ValueError(f"threads: expected >= 1, got {threads}")
    a = np.ones(nbytes // 4, np.float32)  # touched, so no page faults in the timed runs
    prev = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _parallel_sum(a, threads)  # compile / warm
        best = min(timeit(lambda: _parallel_sum(a, threads), repeats=repeats, number=1))
    finally:
        numba.set_num_threads(prev)
    return a.nbytes / best / 1e9


def timeit(fn: Callable[[], object], repeats: int = 5, number: int = 1) -> list[float]:
    """Seconds per call of ``fn`` for each of ``repeats`` runs of ``number`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, the nearest sample (nan when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def cpu_model() -> str:
    """The CPU's name and the vector instruction sets that matter here (benchmarks print it
    beside every figure: machines of this project differ)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    return f"{name} [{' '.join(isa)}]"


def _child(fn, kwargs, conn) -> None:
    try:
        conn.send(fn(**kwargs))
    except Exception as e:  # report, don't hang the parent
        conn.send({"error": f"{type(e).__name__}: {e}"})


def run_isolated(fn: Callable[..., dict], timeout: float = 3600, **kwargs) -> dict:
    """``fn(**kwargs)`` in a fresh process (spawn: clean peak RSS, no shared caches or thread
    pools); its dict result, or ``{"error": ...}``. ``fn`` must be importable by the child (a
    top-level function of the benchmark script)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(fn, kwargs, child))
    p.start()
    out = parent.recv() if parent.poll(timeout) else {"error": f"no answer in {timeout:.0f} s"}
    p.join()
    if p.exitcode and "error" not in out:
        out = {"error": f"exit code {p.exitcode}"}
    return out


def time_llama_cpp(llm, ids: list[int], n_tokens: int) -> tuple[float, float]:
    """llama.cpp's side of a decode benchmark: seconds to prefill ``ids`` and to decode
    ``n_tokens - 1`` greedy tokens after them, from a reset ``llama_cpp.Llama``."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_tokens - 1):
        llm.eval([llm.sample(temp=0.0)])
    return t_prefill, time.perf_counter() - t0


def token_split(phases: dict[str, float], wall: float, tokens: int) -> dict[str, float]:
    """ms per token of each decode-block phase (``cpu.block_times``' seconds, summed over the
    layers and timed in the decode itself, where the parts overlap and share the memory as they
    do there) over ``tokens`` tokens that took ``wall`` seconds, and ``outside``: the rest of a
    token (embedding, head, sampling, Python). Empty where no block ran in C."""
    if not sum(phases.values()):
        return {}
    ms = {k: v * 1e3 / tokens for k, v in phases.items() if v}
    ms["outside"] = wall * 1e3 / tokens - sum(ms.values())
    return ms


def timed_split(run: Callable[[], object], tokens: int) -> tuple[float, dict[str, float]]:
    """``run()`` (which decodes ``tokens`` tokens) with the C blocks' phase timers on: its wall
    time in seconds and ``token_split`` of it (the timers off again after, whatever happens)."""
    from . import cpu

    cpu.block_times(reset=True)
    cpu.set_block_timing(True)
    t0 = time.perf_counter()
    try:
        run()
    finally:
        wall = time.perf_counter() - t0
        cpu.set_block_timing(False)
    return wall, token_split(cpu.block_times(reset=True), wall, tokens)


def split_line(ms: dict[str, float]) -> str:
    """``token_split``'s figures as one line: the total, then each part in ms and its share."""
    total = sum(ms.values())
    return f"{total:.1f} = " + ", ".join(f"{k} {v:.1f} ({v / total:.0%})" for k, v in ms.items())
