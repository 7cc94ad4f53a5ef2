"""Continuous batching without the HTTP server: ``BatchEngine`` driven by client threads in this
process (what ``serve --parallel N`` computes, minus requests, SSE and the client's own parsing).

    python benchmarks/batch_engine.py [--model PATH] [--parallel 8] [--clients 1,8]
                                      [--requests-per-client 2] [--max-tokens 128] [--threads 2]

For each client count C: C threads each stream ``--requests-per-client`` chat answers (a story
about a different topic, seeded sampling at temperature 0.7, end of text ignored) one after the
other. Printed: aggregate tokens/s, p50/p95 inter-token gap seen by the threads, decode steps and
their mean time, prompt tokens reused from a slot's cache; and each level's ratios to one client.
"""

from __future__ import annotations

import argparse
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--clients", default="1,8")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch and numba start their pools
    from sparseinfer.bench import cpu_model
    from sparseinfer.bench import percentile as pct
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, TokenEvent
    from sparseinfer.server.batching import BatchEngine

    engine = Engine.load(a.model, n_ctx=512, threads=a.threads)
    be = BatchEngine(engine, a.parallel)

    def run(clients: int) -> tuple[float, list[float]]:
        gaps: list[float] = []
        lock = threading.Lock()

        def client(c: int) -> None:
            for r in range(a.requests_per_client):
                ids = engine.chat_prompt([{"role": "user",
                                           "content": f"Write a long story about topic {c}-{r}."}])
                params = SamplingParams(max_tokens=a.max_tokens, temperature=0.7,
                                        seed=100 * c + r, ignore_eos=True)
                last, mine = None, []
                for ev in be.stream(ids, params):
                    if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                        now = time.perf_counter()
                        if last is not None:
                            mine.append(now - last)
                        last = now
                with lock:
                    gaps.extend(mine)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, gaps

    run(min(2, a.parallel))  # warm-up
    print(f"# {cpu_model()}; threads {a.threads}; {engine.name}; --parallel {a.parallel}, "
          f"{a.requests_per_client} requests of {a.max_tokens} tokens per client")
    print(f"{'clients':>7} {'tok/s':>8} {'itl p50':>8} {'itl p95':>8} {'steps':>6} {'reused':>7}")
    first = None
    for c in (int(x) for x in a.clients.split(",")):
        steps, reused = be.steps, be.reused_tokens
        wall, gaps = run(c)
        rate = c * a.requests_per_client * a.max_tokens / wall
        p50, p95 = pct(gaps, 0.5) * 1e3, pct(gaps, 0.95) * 1e3
        print(f"{c:>7} {rate:>8.1f} {p50:>6.1f}ms {p95:>6.1f}ms {be.steps - steps:>6} "
              f"{be.reused_tokens - reused:>7}")
        if first is None:
            first = (rate, p95)
        else:
            print(f"        {c} clients / 1: aggregate {rate / first[0]:.2f}x, "
                  f"p95 inter-token {p95 / first[1]:.2f}x")
    be.close()


if __name__ == "__main__":
    main()
