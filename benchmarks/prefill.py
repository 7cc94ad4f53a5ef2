"""Prefill of the sparse runtime: dense (every neuron) vs batched-sparse (the union of the
tokens' predicted active sets) vs "auto" (over q4/int8 rows: each token its own set through the
C kernels' mask), measured to pick the default.

    python benchmarks/prefill.py --sparse out/smollm2.sparse.gguf [-t 2]
    python benchmarks/prefill.py --sparse out/smollm2.sparse.gguf --ffn-dtype int8 --repeats 3
    python benchmarks/prefill.py --sparse /work/r7b/sparse.gguf --dtype auto --ffn-dtype q4 \
        --lengths 32,128 --repeats 2 --no-synthetic
    python benchmarks/prefill.py --synthetic-only

1. The real model (a sparse GGUF from ``sparseinfer convert``): for prompts of T tokens of
   held-out text, the time of the whole prefill with ``batch_mode`` "dense", "union" and
   "auto", and the density of each (share of the neurons computed per token).
2. A Llama-7B-shaped fp32 FFN (4096 x 11008) with ReLU-like sparsity that no model here has:
   each token's active set drawn from skewed per-neuron frequencies averaging 10% (a few hot
   neurons fire for most tokens, most rarely), so the union grows with T as on ReLU models.
   ``kernels.sparse_ffn_batch`` over the union vs torch's dense FFN for the same T tokens.

Best of ``--repeats`` runs each; ratios are of one run (machines are noisy).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

LENGTHS = (2, 4, 8, 16, 64, 256)


def best(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def real_model(path: str, threads: int, repeats: int, ffn_dtype: str = "fp32",
               dtype: str = "fp32", lengths: tuple[int, ...] = LENGTHS,
               batch_ffn: str = "auto") -> None:
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.engine import Engine

    engine = Engine.load(path, n_ctx=1024, threads=threads, dtype=dtype, ffn_dtype=ffn_dtype,
                         batch_ffn=batch_ffn)
    info = engine.sparse_info
    if info is None:
        raise SystemExit(f"{path}: no predictors (expected a file from `sparseinfer convert`)")
    ids = engine.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:20000])
    m = engine.model
    print(f"# {path}: prefill, FFN rows {info.ffn_dtype}, {threads} threads, best of {repeats}; "
          f"{engine.loaded.plan.summary().splitlines()[0]}")
    print(f"{'T':>5} {'dense':>10} {'union':>10} {'auto':>10} {'union dens':>11} "
          f"{'auto dens':>10} {'dense/union':>12} {'union/auto':>11}")
    for T in lengths:
        tokens = torch.tensor([ids[:T]])
        times, dens = {}, {}
        for mode in ("dense", "union", "auto"):
            info.set_batch_mode(mode)

            def run():
                info.reset_stats()
                with torch.inference_mode():
                    m(tokens, 0, m.new_cache(1, T), last_only=True)

            times[mode] = best(run, repeats)
            dens[mode] = info.density()
        print(f"{T:>5} {times['dense'] * 1e3:>8.1f}ms {times['union'] * 1e3:>8.1f}ms "
              f"{times['auto'] * 1e3:>8.1f}ms {dens['union']:>11.1%} {dens['auto']:>10.1%} "
              f"{times['dense'] / times['union']:>11.2f}x {times['union'] / times['auto']:>10.2f}x")
    info.set_batch_mode("auto")


def synthetic(threads: int, repeats: int, mean_density: float = 0.10) -> None:
    from sparseinfer.sparse import kernels
    from sparseinfer.sparse.packed import PackedFFN

    d, f = 4096, 11008
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(f, d, generator=g) / math.sqrt(d)
    up = torch.randn(f, d, generator=g) / math.sqrt(d)
    down = torch.randn(d, f, generator=g) / math.sqrt(f)
    packed = PackedFFN.from_dense("reglu", gate, up, down, dtype="fp32")
    # skewed frequencies: freq_i ∝ (i + 1)^-0.6, scaled to the mean density, capped at 1
    freq = (torch.arange(f, dtype=torch.float64) + 1) ** -0.6
    freq = (freq * (mean_density * f / freq.sum())).clamp(max=1.0)
    print(f"\n# synthetic Llama-7B FFN fp32 (4096 x 11008), per-token density "
          f"{float(freq.mean()):.0%} with skewed frequencies, {threads} threads, best of {repeats}")
    print(f"{'T':>5} {'dense GEMM':>11} {'union kernel':>13} {'union density':>14} "
          f"{'dense/union':>12}")
    for T in (1,) + LENGTHS[:-1]:
        x = torch.randn(T, d, generator=g)
        active = torch.rand(T, f, generator=g, dtype=torch.float64) < freq
        idx = torch.nonzero(active.any(0)).reshape(-1).to(torch.int32)
        out = torch.empty(T, d)

        def dense():
            torch.relu(x @ gate.T).mul_(x @ up.T) @ down.T

        def union():
            kernels.sparse_ffn_batch(x, packed, idx, out)

        td, tu = best(dense, repeats), best(union, repeats)
        print(f"{T:>5} {td * 1e3:>9.2f}ms {tu * 1e3:>11.2f}ms {idx.numel() / f:>14.1%} "
              f"{td / tu:>11.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sparse", default=None, help="sparse GGUF from `sparseinfer convert`")
    ap.add_argument("--synthetic-only", action="store_true")
    ap.add_argument("--ffn-dtype", default="fp32", choices=["fp32", "bf16", "int8", "q4", "auto"])
    ap.add_argument("--dtype", default="fp32", help="the dense parts (as `run --dtype`)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="comma-separated prompt lengths")
    ap.add_argument("--no-synthetic", action="store_true", help="the real model only")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-ffn", default="auto", choices=["auto", "sparse", "dense"],
                    help="as `run --batch-ffn` (with a dense copy, \"dense\" and \"auto\" take it)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from sparseinfer.sparse import kernels

    kernels.set_threads(a.threads)
    if a.sparse and not a.synthetic_only:
        real_model(a.sparse, a.threads, a.repeats, a.ffn_dtype, a.dtype,
                   tuple(int(v) for v in a.lengths.split(",")), a.batch_ffn)
    if not a.no_synthetic:
        synthetic(a.threads, a.repeats)


if __name__ == "__main__":
    main()
