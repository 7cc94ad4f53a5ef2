"""Quantized GEMV over native GGUF blocks (``sparseinfer.cpu``) vs torch's int4 kernel and vs the
memory-bandwidth floor.

    python benchmarks/qgemv.py [--threads 1 2] [--isa avx2 avx512] [--types Q4_0 Q4_K ...]
                               [--model llama-7b smollm2-135m] [--calls N] [--in-cache]

For Llama-7B shapes (4096x4096, 11008x4096, 4096x11008) and SmolLM2-135M shapes (576x576,
1536x576, 576x1536): time of one GEMV (one input vector), the bytes of weights it must read per
microsecond (GB/s), and that as a share of the read bandwidth measured in the same run with the
same thread count (``probe``: the best of many short streaming reads of windows of the same
buffer the kernels read, probed again after every shape, so that kernel and probe are both the
best of many short calls on a shared machine): %bw against the best probe of the whole run, and
%near against the higher of the two probes around the shape's kernels (a virtual machine's
bandwidth drifts by up to 2x within one run: the whole run's best can come from a phase none of
the kernels ran in).

Honest-timing rules (as benchmarks/kernels.py): every call reads a different matrix, a window
into one buffer larger than the last-level cache, so no call is served from cache; the headline
is the best call, the median is beside it; the CPU model, its ISA flags and the load average are
printed so a reader can judge. Weight bytes are random (speed does not depend on the values).
torch's int4 kernel (``torch._weight_int4pack_mm_for_cpu``, bf16 activations, as
``sparseinfer.quant.linear.Int4Linear`` uses it) reads 4.5 bits per weight like Q4_0.

``--plain-read`` adds, for every kernel, the same windows' bytes read by the same C pool
threads with no arithmetic (``cpu.read_gather`` over the window in runs of 16 rows: the order
and look-ahead of the sparse kernels' bundles), and the kernel's GB/s as a share of that: how
much of the gap to the probe is the kernel's and how much the pool's reading.

``--in-cache`` measures the arithmetic instead: one 256x4096 matrix (about 0.6-1 MB, inside
the per-core L2 cache) called again and again, so GB/s is the rate the kernel could consume
weights if memory were free; compare it with the read bandwidth to see the headroom.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time

import numba
import numpy as np
import torch

from sparseinfer import cpu
from sparseinfer.bench import _parallel_sum
from timing import call_times

SHAPES = {  # rows x cols
    "llama-7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536)],
}
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0x16", "Q4_1x16", "Q8_0x16"]
POOL_BYTES = 768 * 2**20  # larger than the (reported) last-level cache of these machines
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "amx_int8")


def cpu_info() -> tuple[str, str]:
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, " ".join(f for f in ISA_FLAGS if f in flags)


IN_CACHE_SHAPE = (256, 4096)


def torch_int4(rows: int, cols: int, pool: int, n: int) -> list[float]:
    """Per-call seconds of torch's int4 GEMV over ``pool`` copies of a random matrix."""
    q = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.randn(cols // 32, rows, 2).to(torch.bfloat16)
    copies = [(packed.clone(), sz.clone()) for _ in range(pool)]
    x = torch.randn(1, cols).to(torch.bfloat16)

    def call(i: int) -> None:
        p, s = copies[i % pool]
        torch._weight_int4pack_mm_for_cpu(x, p, 32, s)

    return call_times(call, n)


def windows(buf: np.ndarray, type_name: str, rows: int, cols: int, n: int,
            in_cache: bool) -> tuple[int, int, int]:
    """A ``type_name`` matrix's bytes, how many windows of ``buf`` the calls walk (1 in cache)
    and how many calls: at least two passes over the windows when there are few."""
    _, elems, size = cpu.TYPES[type_name]
    nbytes = rows * cols // elems * size
    k = 1 if in_cache else buf.size // nbytes
    return nbytes, k, max(n, 2 * k) if k < 64 else n


def ours(buf: np.ndarray, type_name: str, rows: int, cols: int, n: int,
         in_cache: bool = False) -> tuple[list[float], int]:
    nbytes, k, calls = windows(buf, type_name, rows, cols, n, in_cache)
    mats = [cpu.QuantMatrix(type_name, buf[i * nbytes : (i + 1) * nbytes], rows, cols)
            for i in range(k)]
    out = torch.empty(rows)
    x = torch.randn(cols)
    plans = [cpu.GemvPlan([m], [out]) for m in mats]
    return call_times(lambda i: plans[i % k](x), calls), nbytes


def plain_read(buf: np.ndarray, type_name: str, rows: int, cols: int, n: int,
               in_cache: bool = False) -> list[float]:
    """Per-call seconds of reading what ``ours`` reads (the same windows, calls in the same
    order) with the pool's threads and no arithmetic: ``cpu.read_gather`` over each window as
    runs of 16 rows."""
    nbytes, k, calls = windows(buf, type_name, rows, cols, n, in_cache)
    run = nbytes // (rows // 16)  # 16 rows: a panel
    t = torch.from_numpy(buf)
    idx = [torch.arange(i * (rows // 16), (i + 1) * (rows // 16), dtype=torch.int32)
           for i in range(k)]
    return call_times(lambda i: cpu.read_gather(t, run, run, idx[i % k]), calls)


BW_BYTES, BW_REPEATS = 64 * 2**20, 24  # per read: a few ms


def probe(buf: np.ndarray, threads: int) -> float:
    """Read bandwidth as the kernels see it: the best of BW_REPEATS streaming sums (numba, the
    probe of ``sparseinfer.bench.measure_read_bandwidth``), each over the next BW_BYTES window
    of the kernels' own buffer (larger than the last-level cache: this VM reports 480 MiB of L3,
    so a probe of a smaller buffer measures the cache)."""
    a = buf.view(np.float32)
    w = BW_BYTES // 4
    k = a.size // w
    prev = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _parallel_sum(a[:w], threads)
        ts = []
        for i in range(BW_REPEATS):
            view = a[(i % k) * w:(i % k + 1) * w]
            t0 = time.perf_counter()
            _parallel_sum(view, threads)
            ts.append(time.perf_counter() - t0)
    finally:
        numba.set_num_threads(prev)
    return BW_BYTES / min(ts) / 1e9


def fmt(t: float) -> str:
    return f"{t * 1e6:7.0f} us" if t >= 1e-4 else f"{t * 1e6:7.1f} us"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--isa", nargs="+", default=cpu.available_isas(), choices=list(cpu.ops.ISAS))
    p.add_argument("--types", nargs="+", default=TYPES, choices=list(cpu.TYPES))
    p.add_argument("--model", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--no-torch", action="store_true", help="skip torch's int4 kernel")
    p.add_argument("--plain-read", action="store_true",
                   help="beside each kernel: its bytes read by the pool with no arithmetic")
    p.add_argument("--in-cache", action="store_true",
                   help=f"one {IN_CACHE_SHAPE[0]}x{IN_CACHE_SHAPE[1]} matrix reused (arithmetic rate)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, flags = cpu_info()
    print(f"# CPU: {model}; {os.cpu_count()} CPUs; flags: {flags}")
    print(f"# kernels available here: {cpu.available_isas()}; torch {torch.__version__}")
    buf = np.random.default_rng(0).integers(0, 256, POOL_BYTES, dtype=np.uint8)
    where = "one matrix reused (in cache)" if a.in_cache else \
        f"windows of a {POOL_BYTES >> 20} MiB buffer"
    print(f"# times: best call (p50) over {where}; "
          "GB/s = weight bytes / best time; %bw = share of the best read bandwidth of the whole "
          "run; near = the higher of the probes just before and after the shape's kernels "
          "(this VM's bandwidth drifts by up to 2x within a run), %near = share of it")
    hdr = (f"{'thr':>3} {'shape':>11} {'kernel':<14} {'MB':>6} {'best':>10} {'p50':>10} "
           f"{'GB/s':>6} {'%bw':>5} {'near':>5} {'%near':>5}"
           + (f" {'read':>5} {'%read':>5}" if a.plain_read else ""))
    for t in a.threads:
        torch.set_num_threads(t)
        cpu.set_threads(t)
        # the bandwidth probe as the kernels are timed: best of many short reads (a window
        # larger than the cache), repeated after every shape; %bw uses the best reading of all
        bws = [probe(buf, t)]
        print(f"\n# {t} thread(s): load average {os.getloadavg()[0]:.2f}")
        print(hdr)
        print("-" * len(hdr))
        table = []
        shapes = [IN_CACHE_SHAPE] if a.in_cache else [sh for m in a.model for sh in SHAPES[m]]
        for rows, cols in shapes:
            before = bws[-1]  # the probe just before this shape's kernels
            shape = f"{rows}x{cols}"
            rowsout = []
            if not a.no_torch:
                nbytes = rows * cols // 32 * 18
                pool = 1 if a.in_cache else max(2, POOL_BYTES // 2 // nbytes)
                ts = torch_int4(rows, cols, pool, a.calls)
                rowsout.append(("torch int4", nbytes, ts, None))
            for isa in a.isa:
                cpu.set_isa(isa)
                for ty in a.types:
                    if cols % max(32, cpu.TYPES[ty][1]):
                        continue  # no such tensor (llama.cpp falls back to a 32-block type)
                    ts, nbytes = ours(buf, ty, rows, cols, a.calls, a.in_cache)
                    reads = plain_read(buf, ty, rows, cols, a.calls, a.in_cache) \
                        if a.plain_read else None
                    rowsout.append((f"{ty} {isa}", nbytes, ts, reads))
            bws.append(probe(buf, t))
            local = max(before, bws[-1])
            table += [(shape, *row, local) for row in rowsout]
        bw = max(bws)
        for shape, label, nbytes, ts, reads, local in table:
            best = min(ts)
            gbs = nbytes / best / 1e9
            extra = ""
            if a.plain_read:
                rgbs = nbytes / min(reads) / 1e9 if reads else None
                extra = f" {rgbs:>5.1f} {gbs / rgbs:>5.0%}" if rgbs else f" {'-':>5} {'-':>5}"
            print(f"{t:>3} {shape:>11} {label:<14} {nbytes / 1e6:>6.2f} {fmt(best):>10} "
                  f"{fmt(statistics.median(ts)):>10} {gbs:>6.1f} {gbs / bw:>5.0%} "
                  f"{local:>5.1f} {gbs / local:>5.0%}{extra}")
        print(f"# {t} thread(s): read bandwidth {bw:.1f} GB/s (best of {len(bws)} probes, each "
              f"the best of {BW_REPEATS} reads of {BW_BYTES >> 20} MiB windows; probes "
              f"{min(bws):.1f}..{bw:.1f}); load average at the end: {os.getloadavg()[0]:.2f}")
    cpu.set_isa("auto")


if __name__ == "__main__":
    main()
