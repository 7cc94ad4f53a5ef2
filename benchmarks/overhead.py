"""Per-token fixed cost of single-token decode: what a token costs outside the matrix products.

    python benchmarks/overhead.py [-m MODEL] [-t 1 2] [-n TOKENS] [--dtype auto]

For each thread count, on the default model (SmolLM2-135M) with the engine's default build:
- token: one whole decode step (``model(...)`` + greedy ``sample``), best and median;
- blocks: the layer loop alone (every block's one-token forward);
- products: the same layers' matrix products alone (each linear's C GEMV plan called on a
  vector of its input width, no Python work in between beyond the ctypes call, ≈1 µs each);
- outside products, per layer = (blocks - products) / layers: norms, rope, cache write,
  attention, activations, residual adds and the Python dispatch around them; when the blocks
  run as one C call each (``cpu.DecodeBlock``), the same blocks through the numba kernels
  around the block's modules (the path before it) are timed in the same rounds;
- the rest of a token: embedding, final norm, the head's product, sampling; and sampling
  alone (greedy, and top-k 40 / top-p 0.95 at temperature 0.8);
- where the C blocks run: a token split by the blocks' own phase timers (``cpu.block_times``:
  QKV, attention, output projection, FFN, the rest, and outside the blocks), timed after the
  rounds, thread count by thread count.
Ratios to compare: 2-thread / 1-thread for the token and for the products (a second thread can
only speed up what runs on it); the thread counts alternate round by round. The CPU model and
the load average are printed beside the figures; the machine is often shared, so read best
times and same-run ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from sparseinfer.bench import cpu_model, split_line


def interleaved(fns: dict, n: int, threads: list[int], set_threads) -> dict:
    """Seconds of n calls of each function per thread count, taken in turn (each round sets
    each thread count and calls every function once), so that a burst of load from other
    processes hits every measurement alike."""
    for t in threads:
        set_threads(t)
        for fn in fns.values():
            fn()
    out = {t: {k: [] for k in fns} for t in threads}
    for _ in range(n):
        for t in threads:
            set_threads(t)
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                out[t][k].append(time.perf_counter() - t0)
    return out


def product(lin):
    """One-token product of a linear module: its C GEMV plan when it has one (no Python around
    it), else the module's own forward."""
    plan = getattr(lin, "_plan", None)
    return plan if plan is not None else lambda x: lin(x.view(1, 1, -1))


def us(ts: list[float], div: float = 1.0) -> str:
    """best (median) of timings, in µs."""
    return pair(min(ts), statistics.median(ts), div)


def pair(best: float, med: float, div: float = 1.0) -> str:
    return f"{best / div * 1e6:8.1f} ({med / div * 1e6:8.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-n", "--tokens", type=int, default=40, help="rounds of measurements")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()

    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does
    import torch

    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, set_threads
    from sparseinfer.fused.decode import FusedDecode
    from sparseinfer.generate import Uniforms, prefill, sample

    engine = Engine.load(a.model, n_ctx=512, dtype=a.dtype, threads=a.threads[0])
    m = engine.model
    L = len(m.layers)
    fused = m.layers[0].fused
    path = "none"
    if fused is not None:
        fused._prepare(0)
        path = "C block (cpu.DecodeBlock)" if getattr(fused, "_c", None) is not None \
            else "numba kernels around the block's modules"
    print(f"# CPU: {cpu_model()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    print(f"# model {m.cfg.d_model}x{L} layers, plan {engine.dtype}; fused decode: {path}")
    greedy = SamplingParams(temperature=0.0)
    topp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    rng = Uniforms(0)  # a sequence's seeded draws, as the engine samples
    ids = engine.encode("It is a truth universally acknowledged, that a single man in possession")
    numba_path = None  # the same blocks through the numba kernels, timed alongside
    if path.startswith("C block"):
        numba_path = [FusedDecode(b, c_block=False) for b in m.layers]
        try:
            numba_path[0]._prepare(0)
        except RuntimeError as e:  # e.g. Gemma's blocks: only the C block decodes them
            print(f"# no numba path to compare: {e}")
            numba_path = None
    layer_lins = [[sub for sub in b.modules() if hasattr(sub, "in_features")] for b in m.layers]
    head = m.lm_head
    lins = [lin for ls in layer_lins for lin in ls]
    xs = [torch.randn(lin.in_features) for lin in lins]
    kinds = sorted({type(x).__name__ for x in lins})
    print(f"# {len(lins)} products in the layers ({len(layer_lins[0])} per layer, {kinds}); head "
          f"{type(head).__name__}{' (C GEMV)' if getattr(head, '_plan', None) else ''}")
    print("# µs: best (median) over rounds; each round times every item once per thread count, "
          "in turn")
    cache = m.new_cache(1, 512)
    logits = prefill(m, ids, 0, cache)
    pos0 = len(ids)
    tok = [sample(logits, greedy, None)]
    state = {"pos": pos0}

    def step():
        pos = state["pos"]
        state["pos"] = pos0 if pos + 1 >= 400 else pos + 1
        lg = m(torch.tensor([[tok[0]]]), pos, cache, last_only=True)[0, -1]
        tok[0] = sample(lg, greedy, None)

    x = m.tok_emb(torch.tensor([[tok[0]]]))

    def run_blocks(blocks_):
        h = x
        pos = state["pos"]
        for i, b in enumerate(blocks_):
            h = b(h, i, pos, cache, m.rope)

    plans = [(product(lin), xv) for lin, xv in zip(lins, xs)]

    def products():
        for plan, xv in plans:
            plan(xv)

    xh = torch.randn(m.cfg.d_model)
    lg = logits.reshape(-1)
    fns = {"token": step, "blocks": lambda: run_blocks(m.layers), "products": products,
           "head": lambda: product(head)(xh),
           "greedy": lambda: sample(lg, greedy, None),
           "topp": lambda: sample(lg, topp, rng)}
    if numba_path is not None:
        fns["blocks_numba"] = lambda: run_blocks(numba_path)
    res = interleaved(fns, a.tokens, a.threads, set_threads)
    splits = {}  # a token's phases inside the C blocks (cpu.block_times), per thread count
    if path.startswith("C block"):
        from sparseinfer.bench import timed_split

        def steps():
            for _ in range(a.tokens):
                step()

        for threads in a.threads:
            set_threads(threads)
            step()
            splits[threads] = timed_split(steps, a.tokens)[1]
    med = statistics.median
    for threads in a.threads:
        t = res[threads]
        t_token, t_blocks, t_mm = t["token"], t["blocks"], t["products"]
        outside = (min(t_blocks) - min(t_mm), med(t_blocks) - med(t_mm))
        rest = (min(t_token) - min(t_blocks), med(t_token) - med(t_blocks))
        print(f"\n## {threads} thread(s)")
        print(f"token (decode step + greedy sample) {us(t_token)} µs  = "
              f"{1 / min(t_token):.1f} tok/s best, {1 / med(t_token):.1f} median")
        print(f"blocks ({L} layers)                  {us(t_blocks)} µs")
        print(f"  products in the layers            {us(t_mm)} µs")
        print(f"  outside the products, per layer   {pair(*outside, L)} µs")
        if numba_path is not None:
            tb = t["blocks_numba"]
            print("blocks, numba kernels around the modules (the path before the C block):")
            print(f"  blocks                            {us(tb)} µs")
            print(f"  outside the products, per layer   "
                  f"{pair(min(tb) - min(t_mm), med(tb) - med(t_mm), L)} µs")
        sp = splits.get(threads)
        if sp:
            print(f"  inside the C blocks, a token in ms: {split_line(sp)}")
            print(f"  attention and the rest (norms, rope, cache, residuals) per layer "
                  f"{1e3 * (sp['attention'] + sp['rest']) / L:8.1f} µs (without the products' "
                  f"dispatch, in qkv/wo/ffn)")
        print(f"rest of the token (emb, norm, head, sample) {pair(*rest)} µs")
        print(f"  head product                      {us(t['head'])} µs")
        print(f"  sample: greedy {us(t['greedy'])} µs; top-k/top-p {us(t['topp'])} µs")
    if len(a.threads) > 1:
        r1, r2 = res[a.threads[0]], res[a.threads[-1]]
        ratio = lambda k, f: f(r1[k]) / f(r2[k])
        print(f"\n# {a.threads[-1]} vs {a.threads[0]} threads, same rounds: token "
              f"{ratio('token', min):.2f}x (medians {ratio('token', med):.2f}x), layer products "
              f"{ratio('products', min):.2f}x (medians {ratio('products', med):.2f}x), head "
              f"{ratio('head', min):.2f}x")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
