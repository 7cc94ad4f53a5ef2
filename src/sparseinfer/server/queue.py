"""A bounded FIFO of generation jobs served by one worker thread (or ``workers`` of them).

The engine is not thread-safe, so every call into it (templating, tokenizing, generating) happens
on the single worker thread owned by ``Scheduler``. The event loop only enqueues jobs and reads
their events, so a long generation never blocks it.

A job's events travel from the worker to the event loop through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. Cancelling a job (its client went away) removes it from the
waiting line at once, or, if it is running, sets its ``cancel`` event: the engine ends the stream
and the worker stops reading it after at most one more token, then takes the next job.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting line already holds ``max_queue`` jobs."""


class JobFailed:
    """An exception raised by a job's work, delivered to the event loop as an event."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


END = object()  # the last item of every job's event stream


class Job:
    """One unit of work for the worker thread; ``work(job)`` runs there and calls ``emit``."""

    _ids = itertools.count()

    def __init__(self, work: Callable[[Job], None], loop: asyncio.AbstractEventLoop) -> None:
        self.id = next(self._ids)
        self.submitted = time.monotonic()  # for time-to-first-token
        self.work = work
        self.cancel = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Any] = asyncio.Queue()

    def emit(self, item: Any) -> None:
        """Hand ``item`` to the event loop (worker thread side)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel.set()

    async def get(self) -> Any:
        """The next event (event loop side)."""
        return await self._events.get()

    def put_local(self, item: Any) -> None:
        """Inject an event from the event loop itself (e.g. "the client went away")."""
        self._events.put_nowait(item)


class Scheduler:
    """FIFO of at most ``max_queue`` waiting jobs plus the ``workers`` running ones, each on its
    own worker thread (``workers`` > 1 only over an engine that serves several streams at once,
    such as ``batching.BatchEngine``)."""

    def __init__(self, max_queue: int = 16, name: str = "sparseinfer-worker",
                 workers: int = 1) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue: expected >= 0, got {max_queue}")
        if workers < 1:
            raise ValueError(f"workers: expected >= 1, got {workers}")
        self.max_queue = max_queue
        self.workers = workers
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._closed = False
        self._name = name
        self._threads: list[threading.Thread] = []
        self.served = 0  # jobs the worker started (not those cancelled while waiting)

    # -- lifecycle (called from the server's startup / shutdown) --

    def start(self) -> None:
        with self._cv:
            if self._threads:
                return
            self._closed = False
            self._threads = [
                threading.Thread(target=self._loop, name=f"{self._name}-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for thread in self._threads:
                thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job and stop the worker (waits up to ``timeout`` for the running one)."""
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.cancel.set()
                job.emit(END)
            self._waiting.clear()
            for job in self._running:
                job.cancel.set()
            self._cv.notify_all()
            threads, self._threads = self._threads, []
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning(
                    "worker thread still busy after %.1f s; leaving it (daemon)", timeout
                )

    # -- used by request handlers --

    def submit(self, job: Job) -> int:
        """Enqueue ``job``; returns how many jobs are ahead of it. Raises QueueFullError."""
        with self._cv:
            if self._closed:
                raise QueueFullError("the server is shutting down")
            # capacity: the running ones plus max_queue waiting (a job not yet picked up counts
            # as waiting, so two simultaneous requests to an idle one-worker server with
            # max_queue=0 -> one 429)
            if len(self._waiting) + len(self._running) > self.max_queue + self.workers - 1:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})"
                )
            ahead = len(self._waiting) + len(self._running)
            self._waiting.append(job)
            self._cv.notify()
            return ahead

    def cancel(self, job: Job) -> None:
        """Withdraw ``job``: frees its waiting slot now, or stops it if it is running."""
        job.cancel.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running or finished: the worker sees job.cancel
        job.emit(END)

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._cv:
            return len(self._running)

    # -- the worker thread --

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._running.add(job)
                self.served += 1
            try:
                if not job.cancel.is_set():
                    job.work(job)
            except Exception as exc:  # delivered to the request; the worker carries on
                job.emit(JobFailed(exc))
            finally:
                with self._cv:
                    self._running.discard(job)
                job.emit(END)
