"""One token's attention over a float16 KV cache in C (``cpu.attend_token_raw``, the kernel the
fused decode and the batched steps run), per head layout and context length.

    python benchmarks/attention.py [--threads 1 2] [--positions 100,1000,4000] [--calls 200]
                                   [--cycle-mb 256]

Head layouts (query heads, kv heads, head_dim): SmolLM2-135M 9/3/64, Gemma-3-270M 4/1/256,
Llama-2-7B 32/32/128, Llama-3-8B 32/8/128. For each: the best and median time of one call
(rope, the cache write, every head's scores, softmax and weighted sum of V), and the K/V bytes
it reads per microsecond; the CPU model is printed beside it. The calls cycle over copies of the
cache (other layers', as a decode finds them: each layer's keys and values read once a token,
the rest of the model in between) of ``--cycle-mb`` in all, so that each call reads its cache
from memory; ``--cycle-mb 0`` repeats one cache, in L2 or L3 where it fits (the figures before
session 37 were taken that way).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

LAYOUTS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "llama2": (32, 32, 128),
           "llama3": (32, 8, 128)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--positions", default="100,1000,4000")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--cycle-mb", type=float, default=256.0,
                   help="MB of cache copies the calls cycle over (0: one cache, repeated)")
    a = p.parse_args()
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model, timeit

    positions = [int(v) for v in a.positions.split(",")]
    where = f"cycling over {a.cycle_mb:g} MB of caches" if a.cycle_mb > 0 else "one cache, repeated"
    print(f"# {cpu_model()}; kernels: {cpu.get_isa()}; float16 cache, {where}; best (median) "
          f"of {a.calls}")
    print(f"{'thr':>3} {'layout':>8} {'heads':>10} {'pos':>5} {'best us':>9} {'p50 us':>9} "
          f"{'KV GB/s':>8}")
    g = torch.Generator().manual_seed(0)
    for threads in a.threads:
        cpu.set_threads(threads)
        for name, (nh, nkv, hd) in LAYOUTS.items():
            for pos in positions:
                S = pos + 1
                kv_bytes = 2 * nkv * S * hd * 2
                copies = max(1, math.ceil(a.cycle_mb * 1e6 / kv_bytes))
                qkv = torch.randn((nh + 2 * nkv) * hd, generator=g)
                kv = torch.randn(copies, 2, nkv, S, hd, generator=g).half()
                cos, sin = torch.ones(hd), torch.zeros(hd)
                out = torch.empty(nh * hd)
                calls = [(qkv.data_ptr(), kv[c, 0].data_ptr(), kv[c, 1].data_ptr(), True, pos,
                          cos.data_ptr(), sin.data_ptr(), nh, nkv, hd, S, False,
                          1 / math.sqrt(hd), out.data_ptr()) for c in range(copies)]
                for args in calls:  # warm-up (and first touch of every copy)
                    cpu.attend_token_raw(*args)
                turn = itertools.cycle(calls)
                ts = timeit(lambda: cpu.attend_token_raw(*next(turn)), a.calls)
                best, med = min(ts) * 1e6, statistics.median(ts) * 1e6
                print(f"{threads:>3} {name:>8} {f'{nh}/{nkv}/{hd}':>10} {pos:>5} {best:>9.1f} "
                      f"{med:>9.1f} {kv_bytes / best / 1e3:>8.1f}")


if __name__ == "__main__":
    main()
