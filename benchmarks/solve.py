"""Benchmark the placement ILP on a 70B-shaped instance (Llama-2-70B: 80 layers x 28,672 neurons).

    python benchmarks/solve.py [--dtype f16|q4_0] [--budget-gib G] [--seeds N]
                               [--group-size 64] [--min-split 256] [--time-limit 60]

Defaults: f16 with a 64 GiB budget (the fp16 70B attention alone is 22.5 GiB, so 24 GiB cannot
hold the dense parts; think RAM with the cold tier on disk); q4_0 defaults to 24 GiB (an RTX 4090,
PowerInfer's setting for 70B models).

Frequencies are power-law-ish and differ per layer (sharper in the middle layers), as in measured
ReLU-model profiles: a few percent of the neurons carry most activations. A neuron costs its
gate+up+down rows in the stored dtype (f16: 3 * 8192 * 2 bytes; q4_0: 18 bytes per 32 weights).
Dense parts are charged first, in order: embeddings + LM head, a 4k-token fp16 KV cache (GQA,
8 KV heads), attention, rank-1024 fp16 predictors, norms.

Prints wall and CPU seconds: the machine may be shared, and CPU time is the steadier number.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from sparseinfer.offline.solve import PlacementProblem, solve_placement

GIB = 1 << 30
N_LAYERS, D_FF, D_MODEL, VOCAB = 80, 28_672, 8192, 32_000
N_KV_HEADS, HEAD_DIM, CONTEXT = 8, 128, 4096
FP16 = 2
BYTES_PER_WEIGHT = {"f16": 2.0, "q4_0": 18 / 32}
DEFAULT_BUDGET_GIB = {"f16": 64.0, "q4_0": 24.0}


def frequencies(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Per layer: f_i ~ 0.9 / rank^a with lognormal noise, shuffled; a varies with depth."""
    ranks = np.arange(1, D_FF + 1, dtype=np.float64)
    out = []
    for l in range(N_LAYERS):
        a = 0.6 + 0.5 * np.sin(np.pi * l / (N_LAYERS - 1)) + rng.uniform(-0.1, 0.1)
        f = 0.9 * ranks**-a * rng.lognormal(0.0, 0.3, D_FF) + rng.uniform(0, 1e-3, D_FF)
        out.append(rng.permutation(np.clip(f, 0.0, 1.0)))
    return tuple(out)


def dense_parts(w: float) -> tuple[tuple[str, int], ...]:
    """Dense bytes, charged in this order; ``w`` is bytes per weight of the stored dtype."""
    kv = N_LAYERS * 2 * CONTEXT * N_KV_HEADS * HEAD_DIM * FP16
    attention = N_LAYERS * (2 * D_MODEL * D_MODEL + 2 * D_MODEL * N_KV_HEADS * HEAD_DIM) * w
    predictors = N_LAYERS * (D_MODEL * 1024 + 1024 * D_FF) * FP16
    return (
        ("embeddings", int(2 * VOCAB * D_MODEL * w)),  # input embeddings + LM head
        ("kv_cache", kv),
        ("attention", int(attention)),
        ("predictors", predictors),
        ("norms", (2 * N_LAYERS + 1) * D_MODEL * FP16),
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", choices=sorted(BYTES_PER_WEIGHT), default="f16")
    ap.add_argument("--budget-gib", type=float, default=None, help="default: 64 f16, 24 q4_0")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--min-split", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--seeds", type=int, default=1, help="solve this many random instances")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the solver's progress")
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )

    w = BYTES_PER_WEIGHT[args.dtype]
    budget = args.budget_gib if args.budget_gib is not None else DEFAULT_BUDGET_GIB[args.dtype]
    print(
        f"{N_LAYERS} layers x {D_FF} neurons, {args.dtype}, budget {budget:g} GiB, "
        f"group {args.group_size}, min split {args.min_split}"
    )
    for seed in range(args.seeds):
        problem = PlacementProblem(
            freqs=frequencies(np.random.default_rng(seed)),
            neuron_bytes=(int(3 * D_MODEL * w),) * N_LAYERS,
            budget_bytes=int(budget * GIB),
            dense_parts=dense_parts(w),
            group_size=args.group_size,
            min_split_neurons=args.min_split,
        )
        cpu = time.process_time()
        sol = solve_placement(problem, time_limit=args.time_limit)
        cpu = time.process_time() - cpu
        counts = np.array(sol.hot_counts)
        if seed == 0:
            print(
                f"dense {sol.dense_bytes / GIB:.2f} GiB, all neurons "
                f"{problem.neuron_total_bytes / GIB:.2f} GiB"
            )
        print(
            f"seed {seed}: {sol.status}, {sol.solve_seconds:.2f} s wall, {cpu:.2f} s CPU, "
            f"gap {sol.mip_gap:.1e}; {counts.sum() / counts.size / D_FF:.1%} of neurons and "
            f"{sol.objective / sol.total_mass:.2%} of activation mass fast; "
            f"{problem.budget_bytes - sol.fast_bytes} bytes spare; per-layer hot "
            f"min {counts.min()} median {int(np.median(counts))} max {counts.max()}"
        )


if __name__ == "__main__":
    main()
