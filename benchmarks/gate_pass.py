"""The q4 gate pass (``cpu.sparse_q4_gates``: the selected neurons' gate rows, the sparse
default's ReLU gates) against a read of the same rows with no arithmetic (``cpu.read_gather``),
at a 7B layer's shape (d_model 4096, 11,008 gate rows of 2,304 bytes):

- from memory: 8 layers' gate arrays (200 MB, past the L3 cache) in 2 MiB pages as the decode
  holds them (``empty_hugepages``), a random 15% of each layer's rows (the ReGLU benchmark's
  selected share), at 1 and 2 threads, the two timed in alternating rounds; the gate pass's GB/s
  as a share of the read's, and both beside the streaming read probe
  (``bench.measure_read_bandwidth``) measured before and after;
- in cache: 8, 16 or 64 distinct rows taken again and again in one call (20,000 rows a call),
  one thread: ns per block of 32 weights of 8 rows, the arithmetic alone (multiply by the clock,
  e.g. ``vector_pipes_avx2.c``'s, for cycles).

    python benchmarks/gate_pass.py [--rounds 8]

Random q4 rows (small fp16 scales); the CPU is printed beside the figures. Figures:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from sparseinfer import cpu
from sparseinfer.bench import cpu_model, measure_read_bandwidth
from sparseinfer.sparse.packed import empty_hugepages
from timing import alternated

D, F, LAYERS, SHARE = 4096, 11008, 8, 0.15
W = D // 32 * 18  # a q4 row's bytes


def gate_rows(g: torch.Generator) -> torch.Tensor:
    rows = empty_hugepages((F, W), torch.uint8)
    rows.copy_(torch.randint(0, 256, (F, W), dtype=torch.uint8, generator=g))
    rows.view(F, D // 32, 18)[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d ~ 2^-7
    return rows


def median_time(fn, rounds: int) -> float:
    return statistics.median(alternated([lambda i: fn()], rounds)[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layers = [gate_rows(g) for _ in range(LAYERS)]
    x = torch.randn(D, generator=g)
    k = int(SHARE * F)
    sets = [torch.sort(torch.randperm(F, generator=g)[:k])[0].to(torch.int32) for _ in range(LAYERS)]
    print(f"# CPU: {cpu_model()}; kernels {cpu.get_isa()}")
    print(f"from memory: {LAYERS} layers x {k} of {F} rows ({SHARE:.0%}), {W} bytes each")
    nbytes = LAYERS * k * W
    for threads in (2, 1):
        cpu.set_threads(threads)
        probe = measure_read_bandwidth(threads)
        gates, read = map(statistics.median, alternated(
            [lambda _: [cpu.sparse_q4_gates(r, i, x) for r, i in zip(layers, sets)],
             lambda _: [cpu.read_gather(r, W, W, i) for r, i in zip(layers, sets)]], a.rounds))
        probe = max(probe, measure_read_bandwidth(threads))
        print(f"  {threads} thread(s): gate pass {nbytes / gates / 1e9:5.1f} GB/s, the same rows "
              f"read {nbytes / read / 1e9:5.1f} GB/s: {read / gates:.0%}; streaming read probe "
              f"{probe:.1f} GB/s: gate pass {nbytes / gates / 1e9 / probe:.0%}, read "
              f"{nbytes / read / 1e9 / probe:.0%}")
    cpu.set_threads(1)
    print("in cache, one thread (rows repeated in one call of 20,000 rows):")
    for distinct in (8, 16, 64):
        idx = torch.arange(distinct, dtype=torch.int32).repeat(20000 // distinct).contiguous()
        best = min(median_time(lambda: cpu.sparse_q4_gates(layers[0], idx, x), 1)
                   for _ in range(10))
        blocks = idx.numel() / 8 * (D // 32)  # blocks of 32 weights of 8 rows
        print(f"  {distinct:2d} distinct rows ({distinct * W / 1024:.0f} KiB): "
              f"{idx.numel() * W / best / 1e9:5.1f} GB/s, {best / blocks * 1e9:5.2f} ns a block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
