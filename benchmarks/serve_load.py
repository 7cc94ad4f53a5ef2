"""Load benchmark of the OpenAI-compatible server: concurrent streaming clients over loopback.

    python benchmarks/serve_load.py [--engine real|synthetic] [--model PATH] [--clients 1,4,8,16]
                                    [--parallel 1,8] [--requests-per-client 2]
                                    [--max-tokens 32] [--max-queue 16] [--budget 120]
                                    [--prefill-chunk 64] [--step-rows 0,8] [--step-ratio 0,3]
                                    [--no-cache-prompt]
                                    [--client openai|raw]

The server runs in a child process (its own GIL) on 127.0.0.1, port 0, over the real Engine on
the embedded default model (SmolLM2-135M; ``--model``: another file, e.g. a sparse one) unless
``--engine synthetic`` (a fixed-rate fake that measures the server alone). For each concurrency level C, C clients (official ``openai`` async
client, streaming chat; ``--client raw``: the same requests over ``aiohttp``, a lighter load
generator on the server's own cores) share ``--requests-per-client`` x C requests; no new request starts after
``--budget`` seconds, and every started one is awaited. Reported per level: completed / failed /
rejected (429) / lost (must be 0: every request ends in a full answer or an explicit error),
truncated (a stream that ended without finish_reason and usage; must be 0), p50 / p95 time to
first token (includes queueing), p50 / p95 / largest inter-token latency (gaps between content chunks of
one answer), and aggregate completion tokens/s. Every ``--parallel`` value gets its own server
process (1: the one-at-a-time worker on the fused single-token path; N > 1: continuous batching,
``serve --parallel N``; each ``--step-rows`` and ``--step-ratio`` value its own server too: the
budget of a newcomer's prompt rows in a step that also decodes, ``serve --batch-step-rows`` /
``--batch-step-ratio``), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

TOPICS = [
    "the sea",
    "a library",
    "winter",
    "bread",
    "a violin",
    "the moon",
    "rivers",
    "chess",
    "tea",
    "bridges",
    "owls",
    "a lighthouse",
    "maps",
    "rain",
    "clocks",
    "gardens",
]


# -- the server process ---------------------------------------------------------------------------


class SyntheticEngine:
    """EngineProtocol at a fixed rate: ``prefill`` s per request, ``per_token`` s per token."""

    name = "synthetic"

    def __init__(self, n_ctx: int = 2048, prefill: float = 0.02, per_token: float = 0.01):
        self.n_ctx, self.prefill, self.per_token = n_ctx, prefill, per_token

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([1] if add_bos else []) + [3 + b for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages))

    def stream(self, prompt_ids, params, cancel=None) -> Iterator:
        from sparseinfer.engine import FinishEvent, TokenEvent

        cancel = cancel or threading.Event()
        if cancel.wait(self.prefill):
            yield FinishEvent("cancelled", len(prompt_ids), 0)
            return
        n = params.max_tokens if params.max_tokens >= 0 else self.n_ctx - len(prompt_ids)
        for i in range(n):
            if cancel.wait(self.per_token):
                yield FinishEvent("cancelled", len(prompt_ids), i)
                return
            yield TokenEvent(100 + i, f" w{i}")
        yield FinishEvent("length", len(prompt_ids), n)


def _server_process(conn, engine_kind: str, n_ctx: int, threads: int, max_queue: int,
                    parallel: int, prefill_chunk: int, model: str | None,
                    cache_prompt: bool = True, step_rows: int = 0,
                    step_ratio: float = 3.0, batch_ffn: str = "auto") -> None:
    from sparseinfer.threads import passive_wait

    passive_wait()  # as `sparseinfer serve` does, before torch and numba start their pools
    from sparseinfer.server.app import ServerThread, create_app

    if engine_kind == "real":
        from sparseinfer.engine import Engine

        engine = Engine.load(model, n_ctx=n_ctx, threads=threads, batch_ffn=batch_ffn)
        if parallel > 1:
            from sparseinfer.server.batching import BatchEngine, prompt_budget

            engine = BatchEngine(engine, parallel, prefill_chunk=prefill_chunk,
                                 cache_prompt=cache_prompt,
                                 budget=prompt_budget(step_rows, step_ratio))
    else:
        engine = SyntheticEngine(n_ctx=n_ctx)
    with ServerThread(create_app(engine, max_queue=max_queue)) as srv:
        conn.send((srv.base_url, engine.name))
        conn.recv()  # any message (or the parent dying) stops the server


def real_engine_available() -> bool:
    try:
        from sparseinfer.data import default_model_path
        from sparseinfer.engine import Engine  # noqa: F401

        default_model_path()
    except Exception:
        return False
    return True


# -- the clients ----------------------------------------------------------------------------------


@dataclass
class Level:
    clients: int
    issued: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    truncated: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def lost(self) -> int:
        return self.issued - self.completed - self.failed - self.rejected - self.truncated


def _request_body(model: str, i: int, max_tokens: int) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}
        ],
    }


class _Answer:
    """What one streamed answer's chunks said, and when its content arrived."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.finish: str | None = None
        self.completion_tokens: int | None = None

    def chunk(self, content: str | None, finish: str | None) -> None:
        if content:
            now = time.perf_counter()
            if self.first is None:
                self.first = now - self.t0
            else:
                self.gaps.append(now - self.last)
            self.last = now
        self.finish = finish or self.finish

    def count(self, level: Level) -> None:
        if self.completion_tokens is None or self.finish is None:
            level.truncated += 1
            return
        level.completed += 1
        level.tokens += self.completion_tokens
        level.ttft.append(self.first if self.first is not None else time.perf_counter() - self.t0)
        level.itl.extend(self.gaps)


def _failed(level: Level, exc: Exception) -> None:
    level.failed += 1
    key = f"{type(exc).__name__}: {str(exc)[:80]}"
    level.errors[key] = level.errors.get(key, 0) + 1


async def one_request(client, model: str, i: int, max_tokens: int, level: Level) -> None:
    """One streamed chat answer through the official ``openai`` client."""
    import openai

    answer = _Answer()
    try:
        stream = await client.chat.completions.create(**_request_body(model, i, max_tokens))
        async for chunk in stream:
            if chunk.choices:
                answer.chunk(chunk.choices[0].delta.content, chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                answer.completion_tokens = chunk.usage.completion_tokens
        answer.count(level)
    except openai.RateLimitError:
        level.rejected += 1
    except Exception as exc:  # noqa: BLE001 - every failure is counted, by kind
        _failed(level, exc)


async def one_request_raw(session, model: str, i: int, max_tokens: int, level: Level) -> None:
    """The same request over ``aiohttp``, its server-sent events read line by line: a client
    costing a fraction of the SDK's CPU per chunk, for a load generator that shares the server's
    cores."""
    answer = _Answer()
    try:
        async with session.post("chat/completions",
                                json=_request_body(model, i, max_tokens)) as response:
            if response.status == 429:
                level.rejected += 1
                return
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:80]}")
            async for raw in response.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(raw[6:])
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    answer.chunk(choice["delta"].get("content"), choice.get("finish_reason"))
                if chunk.get("usage"):
                    answer.completion_tokens = chunk["usage"]["completion_tokens"]
        answer.count(level)
    except Exception as exc:  # noqa: BLE001 - every failure is counted, by kind
        _failed(level, exc)


async def run_level(
    base_url: str,
    model: str,
    clients: int,
    requests: int,
    max_tokens: int,
    budget: float,
    timeout: float,
    client_kind: str = "openai",
) -> Level:
    level = Level(clients)
    if client_kind == "openai":
        import httpx
        import openai

        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="bench",
            max_retries=0,
            timeout=timeout,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        )
        request = one_request
    else:
        try:
            import aiohttp
        except ImportError:
            raise SystemExit("--client raw needs aiohttp: pip install aiohttp") from None

        client = aiohttp.ClientSession(
            base_url=base_url.rstrip("/") + "/",
            connector=aiohttp.TCPConnector(limit=clients + 4),
            timeout=aiohttp.ClientTimeout(total=timeout),
        )
        request = one_request_raw
    counter = iter(range(requests))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in counter:
            if time.perf_counter() - t0 > budget:
                return
            level.issued += 1
            await request(client, model, i, max_tokens, level)

    await asyncio.gather(*(worker() for _ in range(clients)))
    level.wall = time.perf_counter() - t0
    await client.close()
    return level


def start_server(target, *args):
    """``target(conn, *args)`` (``_server_process`` or a wrapper of it) in a spawned process;
    returns (process, this end of its pipe, base URL, model name) once it reports its address.
    Exits when it dies or takes over 600 s first."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, daemon=True, args=(child, *args))
    proc.start()
    deadline = time.monotonic() + 600
    while not parent.poll(0.5):  # until the server reports its address, dies or times out
        if not proc.is_alive():
            raise SystemExit(f"the server process exited (code {proc.exitcode}) before it "
                             "started: see its traceback above")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server did not start within 600 s")
    base_url, model = parent.recv()
    return proc, parent, base_url, model


def serve_and_measure(args, kind: str, parallel: int, step_rows: int, step_ratio: float,
                      levels: list[int]) -> list[Level]:
    # imported here, not at the top: the server process re-imports this module and must set its
    # OpenMP wait policy before numba (which sparseinfer.bench loads) starts
    from sparseinfer.bench import percentile as pct

    t_load = time.perf_counter()
    proc, parent, base_url, model = start_server(
        _server_process, kind, args.ctx_size, args.threads, args.max_queue, parallel,
        args.prefill_chunk, args.model, not args.no_cache_prompt, step_rows, step_ratio,
        args.batch_ffn)
    ready = time.perf_counter() - t_load
    print(
        f"\nparallel={parallel} engine={kind} model={model} server={base_url} "
        f"(ready in {ready:.1f} s) max_tokens={args.max_tokens} max_queue={args.max_queue} "
        f"requests/level={args.requests_per_client} x clients threads={args.threads}"
        + (f" prefill_chunk={args.prefill_chunk} step_rows={step_rows} step_ratio={step_ratio}"
           if parallel > 1 else "")
        + (" no_cache_prompt" if parallel > 1 and args.no_cache_prompt else "")
        + (f" batch_ffn={args.batch_ffn}" if args.batch_ffn != "auto" else "")
    )
    results: list[Level] = []
    try:
        # warm-up requests (first-call compilation and allocation) outside the measurements
        asyncio.run(run_level(base_url, model, min(2, parallel) if parallel > 1 else 1,
                              2, 4, args.budget, args.timeout, args.client))
        print(
            f"{'clients':>7} {'issued':>6} {'done':>5} {'failed':>6} {'429':>4} {'lost':>4} "
            f"{'trunc':>5} {'ttft p50':>9} {'ttft p95':>9} {'itl p50':>8} {'itl p95':>8} "
            f"{'itl max':>8} {'tok/s':>7} {'wall s':>7}"
        )
        for c in levels:
            lv = asyncio.run(
                run_level(base_url, model, c, c * args.requests_per_client, args.max_tokens,
                          args.budget, args.timeout, args.client)
            )
            results.append(lv)
            print(
                f"{c:>7} {lv.issued:>6} {lv.completed:>5} {lv.failed:>6} {lv.rejected:>4} "
                f"{lv.lost:>4} {lv.truncated:>5} {pct(lv.ttft, 0.5):>8.3f}s "
                f"{pct(lv.ttft, 0.95):>8.3f}s {pct(lv.itl, 0.5) * 1e3:>6.1f}ms "
                f"{pct(lv.itl, 0.95) * 1e3:>6.1f}ms {max(lv.itl, default=0.0) * 1e3:>6.1f}ms "
                f"{lv.tokens / lv.wall if lv.wall else 0:>7.1f} {lv.wall:>7.1f}"
            )
            for err, n in lv.errors.items():
                print(f"        {n} x {err}")
            if args.json:
                print(json.dumps({
                    "engine": kind, "parallel": parallel, "step_rows": step_rows,
                    "step_ratio": step_ratio,
                    "clients": c, "issued": lv.issued,
                    "completed": lv.completed, "failed": lv.failed, "rejected": lv.rejected,
                    "lost": lv.lost, "truncated": lv.truncated,
                    "ttft_p50": pct(lv.ttft, 0.5), "ttft_p95": pct(lv.ttft, 0.95),
                    "itl_p50": pct(lv.itl, 0.5), "itl_p95": pct(lv.itl, 0.95),
                    "itl_max": max(lv.itl, default=None),
                    "ttft_mean": statistics.fmean(lv.ttft) if lv.ttft else None,
                    "tokens": lv.tokens, "wall": lv.wall,
                }))
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return results


def main() -> int:
    from sparseinfer.bench import cpu_model
    from sparseinfer.bench import percentile as pct

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["auto", "real", "synthetic"], default="auto")
    p.add_argument("--model", default=None,
                   help="a model file for the real engine (default: the embedded SmolLM2), "
                        "e.g. a sparse GGUF from `sparseinfer convert`")
    p.add_argument("--clients", default="1,4,8,16", help="comma-separated concurrency levels")
    p.add_argument("--parallel", default="1,8",
                   help="comma-separated --parallel values, each its own server")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="--parallel N > 1: prompt tokens prefilled between two decode steps")
    p.add_argument("--step-rows", default="0",
                   help="--parallel N > 1: comma-separated row budgets of a step that decodes "
                        "(serve --batch-step-rows; 0: none, --step-ratio's instead), each its "
                        "own server")
    p.add_argument("--step-ratio", default="3",
                   help="--parallel N > 1: comma-separated time budgets of a step that decodes "
                        "and takes prompt rows (serve --batch-step-ratio; 0: a whole "
                        "--prefill-chunk), each its own server")
    p.add_argument("--no-cache-prompt", action="store_true",
                   help="--parallel N > 1: run every prompt in full (serve --no-cache-prompt)")
    p.add_argument("--batch-ffn", default="auto", choices=["auto", "sparse", "dense"],
                   help="sparse files: as `serve --batch-ffn` (a dense copy of the FFN for "
                        "several rows at once)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--budget",
        type=float,
        default=120.0,
        help="seconds per level after which no new request starts",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout (s)")
    p.add_argument("--client", choices=["openai", "raw"], default="openai",
                   help="the load generator: the official openai client, or aiohttp reading "
                        "the events line by line (a fraction of the CPU per chunk: the clients "
                        "share the server's cores here)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per level")
    args = p.parse_args()

    kind = args.engine
    if kind == "auto":
        kind = "real" if real_engine_available() else "synthetic"
    levels = [int(c) for c in args.clients.split(",")]
    print(f"# {cpu_model()}; client: {args.client}")
    bad = False
    summary = {}
    ratios = [float(q) for q in args.step_ratio.split(",")]
    # (step_rows, step_ratio) per server: a row budget replaces the time budget, as in serve
    budgets = [b for r in (int(v) for v in args.step_rows.split(","))
               for b in ([(0, q) for q in ratios] if r == 0 else [(r, 0.0)])]
    for parallel in (int(x) for x in args.parallel.split(",")):
        for step_rows, step_ratio in budgets if parallel > 1 else [(0, 0.0)]:
            results = serve_and_measure(args, kind, parallel, step_rows, step_ratio, levels)
            bad |= any(lv.lost or lv.truncated for lv in results)
            label = f"{parallel}" + (f" step_rows={step_rows} step_ratio={step_ratio}"
                                     if parallel > 1 else "")
            summary[label] = {lv.clients: lv for lv in results}
    print("\nratios (same run); 'one stream' = 1 client on the same server / on --parallel 1:")
    serial = summary.get("1", {}).get(1)
    for parallel, by_c in summary.items():
        one = by_c.get(1)
        if one is None or not one.wall or not one.tokens:
            continue
        for c, lv in by_c.items():
            if c == 1 or not lv.wall:
                continue
            line = (f"  parallel={parallel} clients={c}: aggregate tok/s "
                    f"{lv.tokens / lv.wall / (one.tokens / one.wall):.2f}x")
            if serial is not None and serial.tokens:
                line += f" / {lv.tokens / lv.wall / (serial.tokens / serial.wall):.2f}x"
            line += f"; p95 inter-token {pct(lv.itl, 0.95) / pct(one.itl, 0.95):.2f}x"
            if serial is not None and serial.itl:
                line += f" / {pct(lv.itl, 0.95) / pct(serial.itl, 0.95):.2f}x"
            print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
