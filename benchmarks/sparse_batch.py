"""One masked sparse FFN call for several tokens (a batched decode step, a prompt chunk) on a
sparse file's own rows, against the one-token call.

    python benchmarks/sparse_batch.py [--model /work/conv/smollm2.sparse.gguf] [--layer 10]
                                      [--tokens 1,2,8,32,64] [--density 0.93] [-t 2]
                                      [--repeats 400] [--isa avx2] [--cold]

Layer ``--layer`` of the sparse GGUF ``--model`` (its packed rows, as ``run`` loads them), T
random tokens, each with its own random active set of ``--density`` of the neurons (the sparse
SmolLM2 file's predictors select about 93%), the union's bundles read once per call
(``kernels.sparse_ffn_batch`` with a mask, what ``batch_mode`` "masked"/"auto" runs); T = 1 is
the one-token call (no mask). Prints the CPU, the median µs per call and per token. The layer
stays in cache between calls (SmolLM2's 2.7 MB of int8 rows): the arithmetic, not the read.
To compare two trees, run it with each tree's ``PYTHONPATH`` in turn.

``--cold``: instead, the T tokens through every layer in turn (each layer's own random sets of
``--density``), so the rows come from memory as in decoding: ms per sweep, the bundles' and
scales' bytes read per second, and the streaming read probe of the same thread count beside it.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/work/conv/smollm2.sparse.gguf")
    p.add_argument("--layer", type=int, default=10)
    p.add_argument("--tokens", default="1,2,8,32,64")
    p.add_argument("--density", type=float, default=0.93)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--isa", default="auto", help="the C kernels' variant (cpu.set_isa)")
    p.add_argument("--cold", action="store_true",
                   help="one token through every layer in turn (rows from memory)")
    a = p.parse_args()
    from sparseinfer.threads import passive_wait

    passive_wait()
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model, timeit
    from sparseinfer.engine import Engine
    from sparseinfer.sparse import kernels

    cpu.set_isa(a.isa)
    engine = Engine.load(a.model, n_ctx=128, threads=a.threads)
    if engine.sparse_info is None:
        raise SystemExit(f"--model: expected a sparse GGUF, {engine.name} has no sparse layers")
    if a.cold:
        return cold(engine, a)
    ffn = engine.model.layers[a.layer].ffn.packed
    print(f"# {cpu_model()}; kernels {cpu.get_isa()}; threads {a.threads}; {engine.name} layer "
          f"{a.layer}: {ffn.dtype} rows, block {ffn.block}, d_ff {ffn.d_ff}; density "
          f"{a.density}; median of {a.repeats}")
    print(f"{'T':>4} {'us/call':>9} {'us/token':>9}")
    for T in (int(t) for t in a.tokens.split(",")):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, ffn.d_model, generator=g)
        own = torch.rand(T, ffn.d_ff, generator=g) < a.density
        idx = torch.nonzero(own.any(0)).reshape(-1).to(torch.int32)
        mask = own[:, idx.long()].contiguous() if T > 1 else None
        out = torch.empty(T, ffn.d_model)

        def call():
            kernels.sparse_ffn_batch(x, ffn, idx, out, mask)

        for _ in range(200):
            call()
        us = statistics.median(timeit(call, a.repeats)) * 1e6
        print(f"{T:>4} {us:>9.1f} {us / T:>9.1f}")


def cold(engine, a) -> None:
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model, measure_read_bandwidth, timeit
    from sparseinfer.sparse import kernels

    ffns = [layer.ffn.packed for layer in engine.model.layers]
    print(f"# {cpu_model()}; kernels {cpu.get_isa()}; threads {a.threads}; {engine.name}: "
          f"{len(ffns)} layers of {ffns[0].dtype} rows, density {a.density}")
    for T in (int(t) for t in a.tokens.split(",")):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, ffns[0].d_model, generator=g)
        calls = []  # per layer: the union, the tokens' masks over it (None for one token)
        for f in ffns:
            own = torch.rand(T, f.d_ff, generator=g) < a.density
            idx = torch.nonzero(own.any(0)).reshape(-1).to(torch.int32)
            calls.append((f, idx, own[:, idx.long()].contiguous() if T > 1 else None))
        out = torch.empty(T, ffns[0].d_model)

        def sweep():
            for f, idx, mask in calls:
                if mask is None:
                    kernels.sparse_ffn(x[0], f, idx, out[0])
                else:
                    kernels.sparse_ffn_batch(x, f, idx, out, mask)

        nbytes = sum(len(idx) * (f.rows[0].numel() * f.rows.element_size()
                                 + (f.scales[0].numel() * 4 if f.scales is not None else 0))
                     for f, idx, _ in calls)
        for _ in range(20):
            sweep()
        t = statistics.median(timeit(sweep, max(a.repeats // 4, 20)))
        probe = measure_read_bandwidth(a.threads)
        print(f"T {T}: sweep {t * 1e3:.2f} ms ({t * 1e3 / T:.2f} a token), {nbytes / 1e6:.1f} MB: "
              f"{nbytes / t / 1e9:.1f} GB/s; read probe {probe:.1f} GB/s "
              f"({nbytes / t / 1e9 / probe:.0%})")


if __name__ == "__main__":
    main()
