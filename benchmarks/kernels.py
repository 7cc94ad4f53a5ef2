"""Sparse FFN kernels vs the dense FFN and vs the memory-bandwidth floor.

    python benchmarks/kernels.py [-t THREADS] [--quick] [--shape S] [--dtypes q4 int8/32] [--isa avx2]
                                [--kind reglu [--fire 0.17]] [--float-x] [--sets hot-first]

For a Llama-7B FFN (4096 x 11008, SwiGLU) and SmolLM2-135M's (576 x 1536, SwiGLU), each storage
dtype and density: time of ``kernels.sparse_ffn`` on a random active set, the effective bandwidth
of the bytes it must read (active neurons' bundled rows + scales), that as a share of the measured
read bandwidth, that as a share of what the memory gives for the same bundles read in the same
order with nothing computed (``cpu.read_gather``: the access pattern's own ceiling), and the
speedup over the best dense torch FFN of the same weights in the same run.

Active sets: ``random`` (default) draws k of the neurons uniformly, the worst case for the
memory (every bundle a jump); ``hot-first`` draws them with the firing rates of
``relu_7b.py``'s generator (a capped power law: the 20% most active neurons carry 80% of the
activations, as PowerInfer measured on ReLU models) over neurons ordered hottest first, as
``sparseinfer convert`` writes them, so the hot neurons' bundles lie side by side.

Honest-timing rules: every call gets a different layer (a pool of copies larger than the L3
cache, like the layers of a real model) and a different random active set, so nothing is served
from cache. The headline time is the best single call (the same rule as
``measure_read_bandwidth``, and the one that filters out other processes on a shared machine);
the median is shown beside it, and the 1-minute load average is printed so a reader can judge.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
from dataclasses import replace

import numpy as np
import torch

from sparseinfer import cpu
from sparseinfer.bench import cpu_model, measure_read_bandwidth
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN, empty_hugepages
from timing import call_times

log = logging.getLogger("benchmarks.kernels")

SHAPES = {"llama-7b": (4096, 11008), "smollm2-135m": (576, 1536)}
DENSITIES = (0.05, 0.10, 0.20, 0.50)
DTYPES = (("fp32", 0), ("bf16", 0), ("int8", 0), ("int8", 32), ("q4", 0))
POOL_BYTES = 512 * 2**20  # >= 16x the 32 MiB L3 of these machines
MAX_LAYERS = 128
BW_BYTES = 128 * 2**20  # per-row bandwidth probe: 4x L3


def dtype_name(dtype: str, block: int, d: int) -> str:
    if dtype == "int8":
        return "int8/row" if block in (0, d) else f"int8/{block}"
    return dtype


def pool_of(ffn: PackedFFN, nbytes: int) -> list[PackedFFN]:
    """Copies of one layer (own memory) adding up to >= ``POOL_BYTES``."""
    n = max(2, min(MAX_LAYERS, math.ceil(POOL_BYTES / nbytes)))
    clone = lambda t: None if t is None else t.clone()  # noqa: E731

    def huge(t):  # as from_dense / with_q4_gates allocate
        if t is None:
            return None
        out = empty_hugepages(tuple(t.shape), t.dtype)
        return out.copy_(t)

    layers = [ffn]
    for _ in range(n - 1):
        layers.append(replace(ffn, rows=huge(ffn.rows), scales=clone(ffn.scales),
                              up_bias=clone(ffn.up_bias), gates=huge(ffn.gates)))
    return layers


def time_dense(base: PackedFFN, x: torch.Tensor, weights: str, n_calls: int) -> list[float]:
    """Per-call seconds of the dense FFN over a pool of layers with their own dense copies."""
    out = torch.empty(base.d_model)
    dense = kernels.dense_weights(base, weights)
    n = max(2, min(MAX_LAYERS, math.ceil(POOL_BYTES / dense.nbytes)))
    layers = [dense] + [dense.clone() for _ in range(n - 1)]
    ts = call_times(lambda i: kernels.dense_ffn(x, layers[i % n], out), n_calls)
    return ts


def hot_first_rates(d_ff: int, density: float) -> torch.Tensor:
    """``relu_7b.firing_rates`` (mean ``density``), the hottest neuron first."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from relu_7b import firing_rates

    rates = np.sort(firing_rates(d_ff, density, np.random.default_rng(0)))[::-1]
    return torch.from_numpy(rates.copy())


def active_sets(f: int, k: int, sets: str, density: float, g: torch.Generator
                ) -> list[torch.Tensor]:
    """16 sorted int32 sets of k of f neurons: uniform (``random``), or weighted by the
    ``hot-first`` rates without replacement."""
    if sets == "random":
        draws = [torch.randperm(f, generator=g)[:k] for _ in range(16)]
    else:
        w = hot_first_rates(f, density)
        draws = [torch.multinomial(w, k, replacement=False, generator=g) for _ in range(16)]
    return [torch.sort(p)[0].to(torch.int32) for p in draws]


def run(threads: int, shapes: list[str], densities: tuple[float, ...], n_calls: int,
        dtypes: tuple[tuple[str, int], ...] = DTYPES, kind: str = "swiglu",
        fire: float | None = None, sets_kind: str = "random") -> None:
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    cpu.set_threads(threads)  # q4 rows run in the C library's own pool
    kernels.warmup()
    bws = [measure_read_bandwidth(threads)]
    print(f"# CPU: {cpu_model()}; C kernels: {cpu.get_isa()} (of {cpu.available_isas()})")
    fired = "" if fire is None else f" (gates shifted: {fire:.0%} of them fire)"
    print(f"# {threads} threads; {kind} FFN{fired}; measured read bandwidth {bws[0]:.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("# times: best call (p50 in brackets) of calls cycling over a pool of layer copies "
          f">= {POOL_BYTES >> 20} MiB and 16 active sets ({sets_kind})")
    print("# bw: read bandwidth measured just before and after each row, the higher one (on this "
          "VM it drifts between ~33 and ~60 GB/s from minute to minute); %bw = GB/s / bw")  # fmt: skip
    print("# pat: the same neurons' bundled rows (not int8's scales) of the same layers read by "
          "cpu.read_gather in the q4 kernel's order and look-ahead, nothing computed: what the "
          "memory gives for this pattern (best call); %pat = GB/s / pat")  # fmt: skip
    print("# huge: the share of the pool's rows the kernel gave 2 MiB pages (PackedFFN asks for "
          "them; 4 KiB pages cost the sparse rows 10-20%)")
    hdr = (f"{'model':<13} {'dtype':<8} {'dens':>4} {'k':>5} {'sparse (p50)':>20} {'MB':>6} "
           f"{'GB/s':>5} {'bw':>4} {'%bw':>4} {'pat':>4} {'%pat':>4} {'dense (p50)':>20} "
           f"{'dense path':<13} "
           f"{'speedup':>7} {'huge':>4}")  # fmt: skip
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator().manual_seed(0)
    for name in shapes:
        d, f = SHAPES[name]
        gate = torch.randn(f, d, generator=g) / math.sqrt(d)
        up = torch.randn(f, d, generator=g) / math.sqrt(d)
        down = torch.randn(d, f, generator=g) / math.sqrt(f)
        x = torch.randn(d, generator=g)
        if fire is not None:  # shift every gate along x: a share `fire` of gate . x comes out > 0
            thr = torch.quantile(gate @ x, 1.0 - fire)
            gate = gate - torch.outer(torch.ones(f), x) * (thr / (x @ x))
        out = torch.empty(d)
        dense_fp32 = None
        for dtype, block in dtypes:
            base = PackedFFN.from_dense(kind, gate, up, down, dtype=dtype, block=block)
            # dense baseline: torch's fastest path for these weights, measured now
            paths = {"F.linear fp32": "fp32"}
            if dtype == "bf16":
                paths["F.linear bf16"] = "stored"
            if dtype == "int8" and base.block == d:
                paths["int8pack_mm"] = "stored"
            dense = {}
            for label, w in paths.items():
                if w == "fp32" and dense_fp32 is not None:
                    dense[label] = dense_fp32
                    continue
                dense[label] = time_dense(base, x, w, max(8, n_calls // 4))
                if w == "fp32":
                    dense_fp32 = dense[label]
                gc.collect()
            dense_label = min(dense, key=lambda k: min(dense[k]))
            t_dense = min(dense[dense_label])
            huge0 = anon_huge_bytes()
            pool = pool_of(base, base.nbytes)
            huge = (anon_huge_bytes() - huge0) / sum(
                lay.rows.numel() * lay.rows.element_size() for lay in pool[1:])
            for density in densities:
                k = round(f * density)
                sets = active_sets(f, k, sets_kind, density, g)
                n = len(pool)

                def call(i: int, pool=pool) -> None:  # this pool, not the name (deleted below)
                    kernels.sparse_ffn(x, pool[i % n], sets[i % 16], out)

                bw_before = measure_read_bandwidth(threads, nbytes=BW_BYTES, repeats=3)
                ts = call_times(call, max(n_calls, n))
                bw = max(bw_before, measure_read_bandwidth(threads, nbytes=BW_BYTES, repeats=3))
                bws.append(bw)
                pat = gather_bandwidth(pool, sets, max(n_calls, n)) if fire is None else None
                t = min(ts)
                nbytes = k * base.bytes_per_neuron
                gbs = nbytes / t / 1e9
                p50, p50_dense = statistics.median(ts), statistics.median(dense[dense_label])
                print(f"{name:<13} {dtype_name(dtype, block, d):<8} {density:>4.0%} {k:>5} "
                      f"{fmt_time(t):>9} ({fmt_time(p50):>8}) "
                      f"{nbytes / 1e6:>6.2f} {gbs:>5.1f} {bw:>4.0f} {gbs / bw:>4.0%} "
                      f"{fmt_pat(pat, gbs)} "
                      f"{fmt_time(t_dense):>9} ({fmt_time(p50_dense):>8}) "
                      f"{dense_label:<13} {t_dense / t:>6.1f}x {min(huge, 1.0):>4.0%}")  # fmt: skip
            del pool, base
            gc.collect()
    print(f"# read bandwidth over the run: {min(bws):.1f}..{max(bws):.1f} GB/s; "
          f"load average at the end {os.getloadavg()[0]:.2f}")  # fmt: skip


def anon_huge_bytes() -> int:
    """This process's anonymous memory in transparent huge pages (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gather_bandwidth(pool: list[PackedFFN], sets: list[torch.Tensor],
                     n_calls: int) -> float | None:
    """GB/s of the best ``cpu.read_gather`` call over the pool's layers and the active sets, as
    the kernel's calls cycle over them (every neuron's whole bundle of rows); None where a
    bundle is not a multiple of 8 bytes, which the probe cannot read (SmolLM2's q4: 972)."""
    stride = pool[0].rows[0].numel() * pool[0].rows.element_size()
    if stride % 8:
        return None
    n = len(pool)
    ts = call_times(lambda i: cpu.read_gather(pool[i % n].rows, stride, stride, sets[i % 16]),
                    n_calls)
    return sets[0].numel() * stride / min(ts) / 1e9


def fmt_pat(pat: float | None, gbs: float) -> str:
    """The pat and %pat columns (blank for ReLU gates, whose kernel skips rows the probe reads,
    and where the probe cannot read the bundles)."""
    return f"{'-':>4} {'-':>4}" if pat is None else f"{pat:>4.0f} {gbs / pat:>4.0%}"


def fmt_time(t: float) -> str:
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="10%% density only, fewer calls")
    p.add_argument("--shape", choices=sorted(SHAPES), action="append", help="default: all")
    names = {dtype_name(dt, b, 4096): (dt, b) for dt, b in DTYPES}
    p.add_argument("--dtypes", nargs="+", choices=list(names), help="default: all")
    p.add_argument("--kind", default="swiglu", choices=["swiglu", "reglu"],
                   help="reglu: half the neurons' gates come out <= 0 (random gates), whose "
                        "up and down rows the C kernels skip: GB/s is then of the active set's "
                        "bytes, not of the bytes read")
    p.add_argument("--fire", type=float, default=None,
                   help="reglu: the share of neurons whose gate fires for x (default: about "
                        "half, random gates); e.g. 0.17, the share of the predicted neurons "
                        "that fire by the 7B ReGLU file's report (benchmarks/relu_7b.py), or "
                        "0.4, the share its decode fired (RESULTS.md, session 49)")
    p.add_argument("--isa", choices=cpu.available_isas(),
                   help="the C kernels' instruction set (q4 rows); default: the best here")
    p.add_argument("--float-x", action="store_true",
                   help="int8 rows: gate/up products on float32 x with converted weights (the "
                        "kernel before x was rounded to int8 per 32), for an A/B")
    p.add_argument("--sets", default="random", choices=["random", "hot-first"],
                   help="active sets: uniform (default), or power-law firing rates over neurons "
                        "ordered hottest first (see above)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.isa:
        cpu.set_isa(a.isa)
    if a.float_x:
        kernels.rounds_x = lambda ffn: False  # _run_c looks it up at each call
    densities = (0.10,) if a.quick else DENSITIES
    dtypes = tuple(names[n] for n in a.dtypes) if a.dtypes else DTYPES
    run(a.threads, a.shape or list(SHAPES), densities, n_calls=32 if a.quick else 96,
        dtypes=dtypes, kind=a.kind, fire=a.fire, sets_kind=a.sets)


if __name__ == "__main__":
    main()
