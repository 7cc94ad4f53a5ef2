"""Prometheus metrics of the server (``GET /metrics``), one registry per app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5)


class Metrics:
    """Requests by route and status, generated tokens, queue depth, time to first token and
    inter-token latency. ``queue_depth`` / ``running`` are read when scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sparseinfer_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.generated = Counter(
            "sparseinfer_generated_tokens", "completion tokens generated", registry=r
        )
        self.queue = Gauge("sparseinfer_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("sparseinfer_running", "requests being generated", registry=r)
        self.ttft = Histogram(
            "sparseinfer_time_to_first_token_seconds",
            "from the request's arrival in the queue to its first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sparseinfer_inter_token_latency_seconds",
            "between consecutive tokens of one answer",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def watch(self, queued: Callable[[], int], running: Callable[[], int]) -> None:
        self.queue.set_function(queued)
        self.running.set_function(running)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def tokens(self, n: int) -> None:
        self.generated.inc(n)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
