"""Timing loops shared by the benchmark scripts (imported by name: the scripts run from this
folder, ``python benchmarks/NAME.py``, which puts it first on ``sys.path``).

- ``call_times(fn, n)``: ``fn(i)`` for i = 1..n after a warm-up ``fn(0)``, each call timed.
- ``alternated(fns, rounds, per_block)``: several functions timed in turn, ``per_block`` calls
  of each a round, their order reversed every other round, so that this VM's drift from minute
  to minute falls on all of them alike (separate runs cannot tell a few percent apart).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def call_times(fn: Callable[[int], object], n_calls: int) -> list[float]:
    """Seconds of each of ``n_calls`` calls ``fn(i)`` (after one warm-up call ``fn(0)``)."""
    fn(0)
    out = []
    for i in range(1, n_calls + 1):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def alternated(fns: Sequence[Callable[[int], object]], rounds: int,
               per_block: int = 1) -> list[list[float]]:
    """Seconds of each call of each of ``fns``: ``rounds`` rounds, each function called
    ``per_block`` times a round (with i + round, i counting its block's calls), the functions'
    order reversed every other round."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = list(zip(fns, times))
        for fn, t in order if r % 2 == 0 else order[::-1]:
            for i in range(per_block):
                t0 = time.perf_counter()
                fn(i + r)
                t.append(time.perf_counter() - t0)
    return times
