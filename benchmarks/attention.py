"""One token's attention over a float16 KV cache in C (``cpu.attend_token_raw``, the kernel the
fused decode and the batched steps run), per head layout and context length.

    python benchmarks/attention.py [--threads 1 2] [--positions 100,1000,4000] [--calls 200]

Head layouts (query heads, kv heads, head_dim): SmolLM2-135M 9/3/64, Gemma-3-270M 4/1/256,
Llama-2-7B 32/32/128, Llama-3-8B 32/8/128. For each: the best and median time of one call
(rope, the cache write, every head's scores, softmax and weighted sum of V), and the K/V bytes
it reads per microsecond. The cache of the longer positions is past the L2 cache, so the
figure mixes arithmetic and cache reads; the CPU model is printed beside it.
"""

from __future__ import annotations

import argparse
import math
import statistics

LAYOUTS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256), "llama2": (32, 32, 128),
           "llama3": (32, 8, 128)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--positions", default="100,1000,4000")
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    import torch

    from sparseinfer import cpu
    from sparseinfer.bench import cpu_model, timeit

    positions = [int(v) for v in a.positions.split(",")]
    print(f"# {cpu_model()}; kernels: {cpu.get_isa()}; float16 cache; best (median) of {a.calls}")
    print(f"{'thr':>3} {'layout':>8} {'heads':>10} {'pos':>5} {'best us':>9} {'p50 us':>9} "
          f"{'KV GB/s':>8}")
    g = torch.Generator().manual_seed(0)
    for threads in a.threads:
        cpu.set_threads(threads)
        for name, (nh, nkv, hd) in LAYOUTS.items():
            for pos in positions:
                S = pos + 1
                qkv = torch.randn((nh + 2 * nkv) * hd, generator=g)
                kc = torch.randn(nkv, S, hd, generator=g).half()
                vc = torch.randn(nkv, S, hd, generator=g).half()
                cos, sin = torch.ones(hd), torch.zeros(hd)
                out = torch.empty(nh * hd)
                args = (qkv.data_ptr(), kc.data_ptr(), vc.data_ptr(), True, pos, cos.data_ptr(),
                        sin.data_ptr(), nh, nkv, hd, S, False, 1 / math.sqrt(hd), out.data_ptr())
                cpu.attend_token_raw(*args)  # warm-up
                ts = timeit(lambda: cpu.attend_token_raw(*args), a.calls)
                best, med = min(ts) * 1e6, statistics.median(ts) * 1e6
                kv_bytes = 2 * nkv * S * hd * 2
                print(f"{threads:>3} {name:>8} {f'{nh}/{nkv}/{hd}':>10} {pos:>5} {best:>9.1f} "
                      f"{med:>9.1f} {kv_bytes / best / 1e3:>8.1f}")


if __name__ == "__main__":
    main()
