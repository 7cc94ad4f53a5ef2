"""Thread pools that give way when the machine is busy.

torch (GNU OpenMP, with MKL on top) and numba (its ``omp`` threading layer: a second OpenMP
pool) each keep worker threads that, by default, spin on a barrier while they wait for work.
When another process holds a core, a spinning waiter burns the time slice that the thread it
waits for needs, and decode collapses (`benchmarks/threads_under_load.py`, RESULTS.md). A
passive wait policy makes waiting threads sleep instead. OpenMP reads the policy once, when a
pool starts, so ``passive_wait()`` must run before torch or numba is imported: the CLI calls it
first thing; a library user sets ``OMP_WAIT_POLICY=PASSIVE`` in the environment instead.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

WAIT_POLICY_VARS = {"OMP_WAIT_POLICY": "PASSIVE"}


def passive_wait() -> None:
    """Make OpenMP pools that start from now on sleep when idle (a setting already in the
    environment wins)."""
    for name, value in WAIT_POLICY_VARS.items():
        os.environ.setdefault(name, value)
    late = [m for m in ("torch", "numba") if m in sys.modules]
    if late:
        log.info("wait policy set after %s was imported: its pool may still spin",
                 ", ".join(late))


def default_threads() -> int:
    """Threads by default: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_kernel_threads: int | None = None  # the last set_threads count, for kernels imported later


def request_kernel_threads(n: int) -> None:
    """Record the thread count for numba's kernels (``sparse.kernels.set_threads``): applied
    now if they are imported, else when they first are (numba is imported lazily)."""
    global _kernel_threads
    _kernel_threads = n
    kernels = sys.modules.get("sparseinfer.sparse.kernels")
    if kernels is not None:
        kernels.set_threads(n)


def requested_kernel_threads() -> int | None:
    return _kernel_threads


def kernel_threads() -> int:
    """The threads the kernels run with: the count asked for (``-t``), else the default."""
    return _kernel_threads or default_threads()


# Without the C library a model whose decoded token reads fewer weight bytes than this runs on
# one thread unless threads are asked for: torch's and numba's OpenMP teams then wake for every
# product, which costs a small model more than a second thread's share of its reads gains
# (measured on both sides of this line: benchmarks/RESULTS.md, session 45)
ONE_THREAD_BELOW = 384 << 20


def small_model_threads(plan) -> int | None:
    """1 for a model (its load ``plan``) that the C library does not run and whose decoded token
    reads fewer than ``ONE_THREAD_BELOW`` bytes of weights (every weight but embeddings read
    by rows), else None: the default stands."""
    from .cpu import loads as cpu_loads

    if cpu_loads() or default_threads() == 1:
        return None
    per_token = sum(w.nbytes for w in plan.weights if w.storage != "file")
    return 1 if per_token < ONE_THREAD_BELOW else None
