"""Where a served batch loop's time goes: one level of streamed chat clients against the real
engine under ``--parallel N`` (``server.batching.BatchEngine``), the loop thread's iterations timed
from inside the server process.

Each iteration of the loop thread runs one ``decode_step`` over every generating sequence (and a
newcomer's prompt chunk) and samples each row. Timed per iteration: the whole iteration, the
step, and the sampling (``BatchEngine._sampled``, every row) — their difference from an
in-process loop of the same step (``benchmarks/gemm.py``, scratch loops) is what serving costs the
loop: the GIL held by the server's request threads and event loop, their CPU and the clients' on
the same cores. Iterations whose step had exactly N rows (N streams decoding, no prompt) are
reported apart from those carrying a newcomer's prompt chunk and those with fewer streams. A
stream's inter-token gaps are taken at each hand-over on a token's way out — the batch loop
handing it to the stream's thread, that thread passing it to the event loop, the event loop
running the hand-over (waking for it), the stream's generator reading it, formatting its SSE
chunk, uvicorn writing it, the client reading it — so that each stage's share of the tail
shows, with the time between consecutive hand-overs of one token. Per server thread: its time
on a core and its time runnable but waiting for one (``/proc``'s ``schedstat``), per token;
and Python's garbage collections during the run.

    python benchmarks/serve_steps.py [--clients 8] [--parallel 8] [--client raw|openai]

The server is ``serve_load.py``'s (its methods wrapped with timers in the server process only),
and so are the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _timed_server(conn, *server_args) -> None:
    """``serve_load._server_process`` with the batch loop's methods timed; once it stops, the
    log goes back through ``conn``: (kind, start, end, rows) on ``time.monotonic``, the clock
    every process of this machine shares."""
    from sparseinfer.threads import passive_wait

    passive_wait()  # before the import below starts torch (``_server_process`` does it again)
    import serve_load as sl

    import sparseinfer.server.app as app
    import sparseinfer.server.batching as batching
    import sparseinfer.server.queue as jobs

    log: list[tuple[str, float, float, int]] = []
    clock = time.monotonic
    step, iterate, sampled = (batching.decode_step, batching.BatchEngine._iterate,
                              batching.BatchEngine._sampled)

    def timed_step(model, tokens, *a, **k):
        t0 = clock()
        out = step(model, tokens, *a, **k)
        log.append(("step", t0, clock(), int(tokens.shape[0])))
        return out

    def timed_iterate(self):
        t0 = clock()
        iterate(self)
        log.append(("iterate", t0, clock(), 0))

    def timed_sampled(self, seq, logits):
        t0 = clock()
        sampled(self, seq, logits)
        log.append(("sample", t0, clock(), id(seq)))  # the sequence's token handed over at the end

    class TimedQueue(asyncio.Queue):  # a job's events: the event loop runs each put_nowait
        def __init__(self, key: int):
            super().__init__()
            self.key = key

        def put_nowait(self, item):
            t = clock()
            log.append(("queued", t, t, self.key))
            super().put_nowait(item)

    init, emit = jobs.Job.__init__, jobs.Job.emit

    def timed_init(self, *a, **k):
        init(self, *a, **k)
        self._events = TimedQueue(id(self))

    def timed_emit(self, item):  # a request's thread hands an event to the event loop
        t = clock()
        log.append(("emit", t, t, id(self)))
        emit(self, item)

    get = jobs.Job.get

    async def timed_get(self):
        out = await get(self)  # the stream's generator has the event
        t = clock()
        log.append(("got", t, t, id(self)))
        return out

    sse = app.OpenAIServer._sse

    async def timed_sse(self, call, job, *a, **k):
        async for part in sse(self, call, job, *a, **k):
            t = clock()
            yield part  # uvicorn writes it to the socket, then asks for the next
            log.append(("sent", t, clock(), id(job)))

    chunk = app.OpenAIServer._chunk

    def timed_chunk(self, call, rid, *a, **k):
        out = chunk(self, call, rid, *a, **k)  # the event loop formats a stream's SSE chunk
        t = clock()
        log.append(("chunk", t, t, hash(rid)))
        return out

    gc_start = {}

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = clock()
        else:
            log.append(("gc", gc_start.get(0, clock()), clock(), info["generation"]))

    gc.callbacks.append(on_gc)
    batching.decode_step = timed_step
    batching.BatchEngine._iterate = timed_iterate
    batching.BatchEngine._sampled = timed_sampled
    jobs.Job.__init__ = timed_init
    jobs.Job.emit = timed_emit
    jobs.Job.get = timed_get
    app.OpenAIServer._sse = timed_sse
    app.OpenAIServer._chunk = timed_chunk
    names = {}

    def stop_hook():
        for t in threading.enumerate():
            names[t.native_id] = t.name

    recv = conn.recv

    class Conn:  # the stop message: note which thread is which first
        def send(self, m):
            conn.send(m)

        def recv(self):
            m = recv()
            stop_hook()
            return m

    sl._server_process(Conn(), *server_args)
    conn.send((log, names))


def _iterations(log):
    """Per iteration: (rows of its step, iterate s, step s, sampling s); iterations without a
    step (nothing to run) are left out."""
    out = []
    inner = [e for e in log if e[0] in ("step", "sample")]
    i = 0
    for kind, t0, t1, _ in log:
        if kind != "iterate":
            continue
        while i < len(inner) and inner[i][1] < t0:
            i += 1
        rows, step, samp = None, 0.0, 0.0
        while i < len(inner) and inner[i][2] <= t1:
            k, a, b, r = inner[i]
            if k == "step":
                rows, step = r, b - a
            else:
                samp += b - a
            i += 1
        if rows is not None:
            out.append((rows, t1 - t0, step, samp))
    return out


def gaps(log, kind: str) -> list[float]:
    """The gaps between consecutive ``kind`` entries of each sequence or job (by the entry's id),
    in s: a stream's tokens as the batch loop handed them over ("sample"), as its request
    thread passed them to the event loop ("emit"), or as the event loop formatted their chunks
    ("chunk")."""
    last: dict[int, float] = {}
    out = []
    for k, _, t1, key in log:
        if k == kind:
            if key in last:
                out.append(t1 - last[key])
            last[key] = t1
    return out


def lags(log, first: str, then: str) -> list[float]:
    """Per event of each job, the time from its ``first`` entry to its ``then`` entry (the k-th
    of one matched with the k-th of the other), in s."""
    at: dict[str, dict[int, list[float]]] = {first: {}, then: {}}
    for k, _, t1, key in log:
        if k in at:
            at[k].setdefault(key, []).append(t1)
    return [b - a for key, ts in at[first].items()
            for a, b in zip(ts, at[then].get(key, ()))]


def _task_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread of process ``pid``: its time on a core so far and its time runnable but
    waiting for one (``schedstat``), in s."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except OSError:
            continue
        out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9)
    return out


def main() -> int:
    import serve_load as sl

    from sparseinfer.bench import cpu_model
    from sparseinfer.bench import percentile as pct

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model file (default: the embedded SmolLM2)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--client", choices=["openai", "raw"], default="raw")
    args = p.parse_args()
    if args.parallel < 2:
        p.error("--parallel: the batch loop serves 2 or more streams")

    proc, conn, base_url, model = sl.start_server(
        _timed_server, "real", args.ctx_size, args.threads, 16, args.parallel,
        args.prefill_chunk, args.model)
    try:
        asyncio.run(sl.run_level(base_url, model, 2, 2, 4, 600, 600, args.client))  # warm-up
        cpu0 = _task_cpu(proc.pid)
        since = time.monotonic()
        lv = asyncio.run(sl.run_level(base_url, model, args.clients,
                                      args.clients * args.requests_per_client, args.max_tokens,
                                      600, 600, args.client))
        cpu1 = _task_cpu(proc.pid)
    finally:
        conn.send("stop")
    log, names = conn.recv()
    log = [e for e in log if e[1] >= since]
    proc.join(30)
    its = _iterations(log)
    full = [x for x in its if x[0] == args.parallel]
    chunked = [x for x in its if x[0] > args.parallel]
    fewer = [x for x in its if x[0] < args.parallel]
    print(f"# {cpu_model()}; client: {args.client}")
    print(f"model={model} parallel={args.parallel} clients={args.clients} "
          f"answers={lv.completed}/{lv.issued} tokens={lv.tokens} in {lv.wall:.2f} s: "
          f"{lv.tokens / lv.wall:.1f} tok/s")
    print("inter-token gaps, p50 / p90 / p95 / p99 (ms): where the tail is added")
    for name, v in (("handed over by the batch loop", gaps(log, "sample")),
                    ("passed to the event loop", gaps(log, "emit")),
                    ("queued by the event loop", gaps(log, "queued")),
                    ("read by the stream", gaps(log, "got")),
                    ("formatted by the event loop", gaps(log, "chunk")),
                    ("written by uvicorn", gaps(log, "sent")),
                    ("seen by the clients", lv.itl)):
        print(f"  {name:30s} " + " / ".join(f"{pct(v, q) * 1e3:5.1f}"
                                              for q in (0.5, 0.9, 0.95, 0.99)))
    print("time from one hand-over to the next, p50 / p90 / p95 / p99 (ms)")
    for name, v in (("event loop wakes for an event", lags(log, "emit", "queued")),
                    ("the stream reads it", lags(log, "queued", "got")),
                    ("uvicorn writes a chunk", [e[2] - e[1] for e in log if e[0] == "sent"])):
        print(f"  {name:30s} " + " / ".join(f"{pct(v, q) * 1e3:5.2f}"
                                              for q in (0.5, 0.9, 0.95, 0.99)))
    roles: dict[str, list[float]] = {}
    for tid, (run, wait) in cpu1.items():
        name = names.get(tid, "C pool / other")
        name = "request threads" if name.startswith("sparseinfer-worker") else name
        was = cpu0.get(tid, (0.0, 0.0))
        role = roles.setdefault(name, [0.0, 0.0])
        role[0] += run - was[0]
        role[1] += wait - was[1]
    print(f"server threads per token streamed: µs on a core / µs runnable, waiting for one "
          f"({lv.tokens} tokens in {lv.wall:.2f} s)")
    for name, (run, wait) in sorted(roles.items(), key=lambda x: -x[1][0]):
        print(f"  {name:30s} {run / lv.tokens * 1e6:7.0f} / {wait / lv.tokens * 1e6:7.0f}")
    for g in (0, 1, 2):
        v = [e[2] - e[1] for e in log if e[0] == "gc" and e[3] == g]
        if v:
            print(f"garbage collections of generation {g}: {len(v)}, p50 {pct(v, 0.5) * 1e3:.2f} "
                  f"max {max(v) * 1e3:.2f} ms, {sum(v) * 1e3:.1f} ms in all")
    counts = collections.Counter(x[0] for x in its)
    print("iterations by rows in their step: " +
          ", ".join(f"{r}: {counts[r]}" for r in sorted(counts)))
    print(f"iterations whose step had {args.parallel} rows (decoding only): {len(full)}")
    for j, name in ((1, "iteration"), (2, "decode_step"), (3, "sampling")):
        v = [x[j] for x in full]
        if v:
            print(f"  {name:12s} p50 {pct(v, 0.5) * 1e3:6.2f} ms  mean {sum(v) / len(v) * 1e3:6.2f}"
                  f"  p95 {pct(v, 0.95) * 1e3:6.2f}")
    for name, group in (("with a prompt chunk riding along", chunked),
                        ("with fewer streams", fewer)):
        if group:
            v = [x[1] for x in group]
            print(f"iterations {name}: {len(group)}, rows {min(x[0] for x in group)}-"
                  f"{max(x[0] for x in group)}; iteration p50 {pct(v, 0.5) * 1e3:.2f} ms, "
                  f"p95 {pct(v, 0.95) * 1e3:.2f}, max {max(v) * 1e3:.2f}")
    return 0 if lv.completed == lv.issued else 1


if __name__ == "__main__":
    raise SystemExit(main())
