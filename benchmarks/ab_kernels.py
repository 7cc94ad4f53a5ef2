"""Two builds of the C library against each other in one process: the sparse FFN kernels, or
the GEMV of given block types (``--gemv``; with ``--rows-of-x``, their GEMM), or the loader's
repacking of a file's rows into those panel types (``--pack``).

    python benchmarks/ab_kernels.py --rev HEAD~1 [--isa avx2] [--dtypes q4 int8/32 q4-gates] [-t 2]
    python benchmarks/ab_kernels.py --rev HEAD~1 --dtypes q4g q4i8 --fire 0.4
    python benchmarks/ab_kernels.py --rev HEAD~1 --isa avx512 --gemv Q4_Kx16 Q5_Kx16 --rounds 8
    python benchmarks/ab_kernels.py --old path/to/libsicpu.so ... [--hot]
    python benchmarks/ab_kernels.py --same --isa avx2 --new-isa avx2_vnni --gemv Q4_Kx16 --hot
    python benchmarks/ab_kernels.py --rev HEAD~1 --isa avx512 --gemv Q4_1x16 --rows-of-x 8 --hot
    python benchmarks/ab_kernels.py --rev HEAD~1 --pack Q4_0x16 Q6_Kx16b --rounds 8 --per-block 1

``--rev`` checks that revision out in a temporary git worktree, builds its library there and
removes the worktree after; "new" is this tree's built library (``python -m
sparseinfer.cpu.build``); ``--same``: this library against itself, ``--new-isa`` then naming the
other kernel variant (two ISAs of one build). Both are loaded side by side (each with its own thread pool) and called
on the same inputs — a 7B-shape SwiGLU FFN (``--fire``: ReGLU), a pool of layer copies larger
than the L3 cache, 16 random active sets at 10% density — in alternating blocks of calls, so a
change of a few percent can be told from this VM's drift from minute to minute (memory
bandwidth moving 30-60 GB/s), which separate runs of ``kernels.py`` cannot. Prints per build the best, p10, p50 and mean call
time, the new / old ratios, and in how many rounds (one block of each) new was faster. Outputs of
the two builds are compared once (equal, or the largest difference, printed). A build from before
q4 rows put their scales first (ABI 18) is given the same numbers as Q4_0 blocks. ``q4g`` and
``q4i8`` (with ``--fire``): one token of a ReLU gate's default rows, ``si_sparse_i8_q4g``'s two
passes over the gates apart as q4 rows and int8 up/down bundles (``q4g``) or bundles of q4 ups
and int8 down rows (``q4i8``, ``PackedFFN.with_q4_ups``). ``--hot``: one
layer and one active set instead, in cache after the first call: the kernels' arithmetic without
the memory.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import sparseinfer
from sparseinfer.bench import cpu_model
from sparseinfer.sparse.packed import PackedFFN, empty_hugepages, q4_blocks, quantize_q4_rows

ROOT = Path(__file__).resolve().parent.parent
ISAS = {"avx2": 0, "avx512": 1, "avx2_128": 2, "avx2_vnni": 3}
Q4_ROWS_ABI = 19  # the first ABI whose q4 rows are scales, then quants (before: Q4_0 blocks)
IDENTITY, RELU, SILU = 0, 1, 2  # sparse/kernels.py ACT_CODES


def kernels_bench():
    """benchmarks/kernels.py as a module (its pool of layer copies)."""
    spec = importlib.util.spec_from_file_location("kernels_bench", ROOT / "benchmarks" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_rev(rev: str) -> Path:
    """The library of git revision ``rev``, built in a temporary worktree (removed at exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="sparseinfer-ab-"))
    wt = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), rev],
                   check=True, capture_output=True)

    def remove() -> None:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(remove)
    env = dict(os.environ, PYTHONPATH=str(wt / "src"))
    subprocess.run([sys.executable, "-m", "sparseinfer.cpu.build"], check=True, env=env,
                   capture_output=True)
    return wt / "src" / "sparseinfer" / "cpu" / "libsicpu.so"


def load(path: Path, isa: str, threads: int) -> ctypes.CDLL:
    if not path.is_file():
        raise SystemExit(f"no library at {path}: build it first (python -m sparseinfer.cpu.build)")
    lib = ctypes.CDLL(str(path))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.si_sparse_q4.argtypes = [vp, ctypes.c_size_t, ci, vp, ci, vp, ci, vp, ci, ci, ci, ci, vp,
                                 vp]
    lib.si_sparse_i8.argtypes = [vp, vp, ci, ci, ci, vp, ci, vp, ci, vp, ci, ci, ci, ci, ci, vp,
                                 vp, vp, ctypes.c_size_t, ci]
    lib.si_sparse_i8_q4g.argtypes = [vp, vp, ci, ci, vp, ctypes.c_size_t, vp, ci, ci, vp, ci, ci,
                                     ci, vp, ci]
    lib.si_sparse_q4_gates.argtypes = [vp, ctypes.c_size_t, vp, ci, ci, vp, ci, vp]
    lib.si_gemv.argtypes = [ci, vp, vp, vp, ci, vp, vp]
    lib.si_gemm.argtypes = [ci, vp, ctypes.c_int64, ci, vp, ctypes.c_int64, vp]
    lib.si_to_panels.argtypes = [ci, vp, ctypes.c_int64, ci, vp]
    if lib.si_set_isa(ISAS[isa]) != 0:
        raise SystemExit(f"{path}: this CPU cannot run {isa}")
    if lib.si_set_threads(threads) != 0:
        raise SystemExit(f"{path}: set_threads({threads}) failed")
    return lib


def caller(lib: ctypes.CDLL, layer: PackedFFN, x: torch.Tensor, out: torch.Tensor, ga: int,
           gates: bool):
    """call(idx): one sparse FFN over active set idx with this build (gate activation ga); with
    ``gates``, the q4 gate rows' dot products alone (``si_sparse_q4_gates``, into out[:k])."""
    d, f = layer.d_model, layer.d_ff
    if layer.gates is not None:  # q4g / q4i8: one token, si_sparse_i8_q4g's two passes
        q4u = int(layer.dtype == "q4i8")
        scales = None if q4u else layer.scales.data_ptr()

        def call(idx: torch.Tensor) -> int:
            return lib.si_sparse_i8_q4g(layer.rows.data_ptr(), scales, layer.block,
                                        layer.rows.shape[1], layer.gates.data_ptr(),
                                        layer.gates.shape[1], idx.data_ptr(),
                                        idx.numel(), f, x.data_ptr(), 1, d, IDENTITY,
                                        out.data_ptr(), q4u)
    elif gates:
        bb = layer.rows[0].numel()

        def call(idx: torch.Tensor) -> int:
            return lib.si_sparse_q4_gates(layer.rows.data_ptr(), bb, idx.data_ptr(), idx.numel(),
                                          f, x.data_ptr(), d, out.data_ptr())
    elif layer.dtype == "q4":
        bb = layer.rows[0].numel()

        def call(idx: torch.Tensor) -> int:
            return lib.si_sparse_q4(layer.rows.data_ptr(), bb, 1, idx.data_ptr(), idx.numel(),
                                    None, f, x.data_ptr(), 1, d, ga, IDENTITY, None,
                                    out.data_ptr())
    else:
        def call(idx: torch.Tensor) -> int:
            return lib.si_sparse_i8(layer.rows.data_ptr(), layer.scales.data_ptr(), layer.block, 1,
                                    layer.rows.shape[1], idx.data_ptr(), idx.numel(), None, f,
                                    x.data_ptr(), 1, 1, d, ga, IDENTITY, None, out.data_ptr(),
                                    None, 0, 0)
    return call


def alternate(call: Callable[[str, int], object], rounds: int, per_block: int
              ) -> tuple[dict[str, list[float]], int]:
    """``call(name, i)`` for the builds "old" and "new" in alternating blocks of ``per_block``
    calls (i counting every call), each call timed: (seconds per call by build, the rounds in
    which new's block was the faster on average)."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    wins, i = 0, 0
    for r in range(rounds):
        means = {}
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            ts = []
            for _ in range(per_block):
                t0 = time.perf_counter()
                call(name, i)
                ts.append(time.perf_counter() - t0)
                i += 1
            times[name] += ts
            means[name] = statistics.fmean(ts)
        wins += means["new"] < means["old"]
    return times, wins


def run(libs: dict[str, ctypes.CDLL], dtype: str, block: int, rounds: int, per_block: int,
        fire: float | None, gates: bool = False, hot: bool = False, apart: str = "") -> None:
    """One sparse FFN kind (``apart``: "q4g" or "q4i8", the gates apart as q4 rows, one token)
    in both builds."""
    kb = kernels_bench()
    d, f = kb.SHAPES["llama-7b"]
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(f, d, generator=g) / d**0.5
    up = torch.randn(f, d, generator=g) / d**0.5
    down = torch.randn(d, f, generator=g) / f**0.5
    x = torch.randn(d, generator=g)
    if fire is not None:  # ReGLU, gates shifted so a share `fire` comes out > 0 (as kernels.py)
        thr = torch.quantile(gate @ x, 1.0 - fire)
        gate = gate - torch.outer(torch.ones(f), x) * (thr / (x @ x))
    kind = "swiglu" if fire is None else "reglu"
    base = PackedFFN.from_dense(kind, gate, up, down, dtype=dtype, block=block)
    if apart:
        base = base.with_q4_gates(quantize_q4_rows(gate))
        if apart == "q4i8":
            base = base.with_q4_ups(quantize_q4_rows(up))
    # --hot: the one layer, its bundles (a few MB at 10%) in the L3 cache after the first call
    pool = [base] if hot else kb.pool_of(base, base.nbytes)
    pools = {name: pool for name in libs}
    for name, lib in libs.items():
        if dtype == "q4" and lib.si_abi_version() < Q4_ROWS_ABI:  # its own copies, as pool_of's
            pools[name] = [replace(layer, rows=empty_hugepages(tuple(layer.rows.shape),
                                                               torch.uint8))
                           for layer in pool]
            for mine, layer in zip(pools[name], pool):
                mine.rows.copy_(q4_blocks(layer.rows))
    k = round(0.10 * f)
    sets = [torch.sort(torch.randperm(f, generator=g)[:k])[0].to(torch.int32)
            for _ in range(1 if hot else 16)]
    outs = {name: torch.zeros(d) for name in libs}  # the gates write only out[:k]
    ga = SILU if fire is None else RELU
    calls = {name: [caller(lib, layer, x, outs[name], ga, gates) for layer in pools[name]]
             for name, lib in libs.items()}
    for name, cs in calls.items():  # warm-up, and the two builds' outputs
        if cs[0](sets[0]) != 0:
            raise SystemExit(f"{name}: the kernel refused its arguments")
    diff = (outs["old"] - outs["new"]).abs().max().item()
    times, wins = alternate(lambda name, i: calls[name][i % len(calls[name])](sets[i % len(sets)]),
                            rounds, per_block)
    label = "q4 gate rows alone" if gates else kb.dtype_name(dtype, block, d)
    if apart:
        label += ", gates apart" + (", q4 ups" if apart == "q4i8" else "")
    mb = k * (base.rows[0, 0].numel() if gates else base.bytes_per_neuron) / 1e6
    if apart:  # every selected neuron's gate row, the rest where it fired (counted: the gates'
        # own arithmetic, sparseinfer.cpu's, over the sets)
        from sparseinfer import cpu

        g_row = base.gates.shape[1]
        n_fired = statistics.fmean(int((cpu.sparse_q4_gates(base.gates, s, x) > 0).sum())
                                   for s in sets)
        mb = (k * g_row + n_fired * (base.bytes_per_neuron - g_row)) / 1e6
    fired = "" if fire is None else f", ReGLU with {fire:.0%} of the gates firing"
    where = ", in cache (--hot)" if hot else ""
    print(f"\nllama-7b {label}, 10% ({k} neurons, {mb:.2f} MB a call{fired}{where}); outputs "
          f"{'equal' if diff == 0 else f'differ by up to {diff:.3g}'}")
    stats = {}
    for name, ts in times.items():
        a = np.array(ts) * 1e6
        stats[name] = (a.min(), np.percentile(a, 10), np.median(a), a.mean())
        print(f"  {name}: best {a.min():6.0f} us ({mb / a.min() * 1e3:4.1f} GB/s)  p10 "
              f"{stats[name][1]:6.0f}  p50 {stats[name][2]:6.0f}  mean {a.mean():6.0f} us  "
              f"({len(a)} calls)")
    o, n = stats["old"], stats["new"]
    print(f"  new / old: best {n[0] / o[0]:.3f}, p10 {n[1] / o[1]:.3f}, p50 {n[2] / o[2]:.3f}, "
          f"mean {n[3] / o[3]:.3f}; new faster in {wins} of {rounds} rounds")


def print_rates(times: dict[str, list[float]], wins: int, rounds: int, nbytes: int) -> None:
    """Each build's best and p50 rate over ``nbytes`` a call, and new's speed against old's."""
    med = {}
    for name, ts in times.items():
        med[name] = np.median(ts)
        print(f"  {name}: best {nbytes / min(ts) / 1e9:5.2f} GB/s  p50 "
              f"{nbytes / med[name] / 1e9:5.2f} GB/s  ({len(ts)} calls)")
    print(f"  new / old speed at p50 {med['old'] / med['new']:.3f}; new faster in {wins} of "
          f"{rounds} rounds")


GEMV_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # llama-7b's projections
GEMV_POOL = 1 << 30  # bytes of random blocks the matrices are windows of (past the L3 cache)


def run_gemv(libs: dict[str, ctypes.CDLL], type_name: str, rounds: int, per_block: int,
             hot: bool, t_rows: int = 1) -> None:
    """One GEMV (``si_gemv``, a decode step's product; ``t_rows`` > 1: ``si_gemm`` over that
    many rows of x, a batched step's) of a ``type_name`` matrix at each 7B shape (``--hot``: one
    256 x 4096 matrix, in cache) with the two builds, alternated in blocks of calls, each call
    on the next matrix of a pool larger than the L3 cache. The weights are random bytes (a scale
    may be inf or NaN: the time is the same); outputs compared as bits."""
    from sparseinfer import cpu

    _, elems, size = cpu.TYPES[type_name]
    buf = np.random.default_rng(0).integers(0, 256, GEMV_POOL, dtype=np.uint8)
    for rows, cols in [(256, 4096)] if hot else GEMV_SHAPES:
        nbytes = rows * cols // elems * size
        mats = [cpu.QuantMatrix(type_name, buf[i * nbytes:(i + 1) * nbytes], rows, cols)
                for i in range(1 if hot else GEMV_POOL // nbytes)]
        x = torch.randn(t_rows, cols)
        outs = {name: torch.empty(t_rows, rows) for name in libs}
        vp, i64 = ctypes.c_void_p, ctypes.c_int64

        def args(m, out):
            if t_rows > 1:
                return (m.code, vp(m.ptr), i64(rows), cols, vp(x.data_ptr()), i64(t_rows),
                        vp(out.data_ptr()))
            return (1, (ctypes.c_int * 1)(m.code), (vp * 1)(m.ptr), (i64 * 1)(rows), cols,
                    x.data_ptr(), (vp * 1)(out.data_ptr()))

        fn = "si_gemm" if t_rows > 1 else "si_gemv"
        calls = {name: [args(m, outs[name]) for m in mats] for name in libs}
        for name, lib in libs.items():
            if getattr(lib, fn)(*calls[name][0]) != 0:
                raise SystemExit(f"{name}: {fn} refused {type_name}")
        same = np.array_equal(outs["old"].numpy(), outs["new"].numpy(), equal_nan=True)
        times, wins = alternate(
            lambda name, i: getattr(libs[name], fn)(*calls[name][i % len(calls[name])]), rounds,
            per_block)
        what = f"GEMM x{t_rows}" if t_rows > 1 else "GEMV"
        print(f"\n{type_name} {what} {rows}x{cols} ({nbytes / 1e6:.2f} MB a call"
              f"{', in cache (--hot)' if hot else ''}); outputs {'equal' if same else 'DIFFER'}")
        print_rates(times, wins, rounds, nbytes)


def run_pack(libs: dict[str, ctypes.CDLL], panel: str, rounds: int, per_block: int) -> None:
    """The loader's repacking (``si_to_panels``: a file's rows of random blocks into panels of
    type ``panel``, each call into a new array, as the loader makes them, so the new pages' faults
    are counted) at the 7B FFN's shapes with the two builds, alternated; outputs compared."""
    from sparseinfer import cpu
    from sparseinfer.cpu.panels import FILE_TYPES

    code, elems, size = cpu.TYPES[panel]
    rng = np.random.default_rng(0)
    for rows, cols in GEMV_SHAPES[1:]:
        raw = rng.integers(0, 256, rows * cols // elems * size, dtype=np.uint8)
        outs: dict[str, np.ndarray] = {}

        def call(name: str, i: int) -> None:
            outs[name] = np.empty_like(raw)
            if libs[name].si_to_panels(code, raw.ctypes.data, rows, cols,
                                       outs[name].ctypes.data) != 0:
                raise SystemExit(f"{name}: si_to_panels refused {panel}")

        times, wins = alternate(call, rounds, per_block)
        same = np.array_equal(outs["old"], outs["new"])
        print(f"\n{FILE_TYPES[panel]} rows -> {panel} panels, {rows}x{cols} ({raw.nbytes / 1e6:.1f} MB);"
              f" outputs {'equal' if same else 'DIFFER'}")
        print_rates(times, wins, rounds, raw.nbytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--rev", help="git revision whose library is 'old' (built in a worktree)")
    src.add_argument("--old", type=Path, help="a built libsicpu.so to use as 'old'")
    src.add_argument("--same", action="store_true", help="'old' is the 'new' library too (with "
                     "--new-isa: two kernel variants of one build)")
    p.add_argument("--new", type=Path, default=Path(sparseinfer.__file__).parent / "cpu" / "libsicpu.so",
                   help="default: this tree's library")
    p.add_argument("--isa", choices=list(ISAS), default="avx2")
    p.add_argument("--new-isa", choices=list(ISAS), help="the kernels 'new' runs (default --isa)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+",
                   choices=["q4", "int8/row", "int8/32", "q4-gates", "q4g", "q4i8"],
                   default=["q4"], help="q4-gates: the gate rows' dot products alone (the disk "
                   "tier's ReLU gates apart); q4g, q4i8 (with --fire): one token over the "
                   "gates apart, int8 up/down rows or q4 ups beside int8 down rows")
    p.add_argument("--gemv", nargs="+", metavar="TYPE", help="instead of the sparse FFN: the "
                   "GEMV of these cpu.TYPES (e.g. Q4_Kx16) at the 7B shapes")
    p.add_argument("--pack", nargs="+", metavar="TYPE", help="instead of the sparse FFN: the "
                   "loader's repacking of file rows into these panel types (e.g. Q6_Kx16b)")
    p.add_argument("--rows-of-x", type=int, default=1, help="with --gemv: a GEMM over this many "
                   "rows of x (a batched decode step's), not a GEMV")
    p.add_argument("--rounds", type=int, default=60, help="blocks of each build (default 60)")
    p.add_argument("--per-block", type=int, default=20, help="calls a block (default 20)")
    p.add_argument("--hot", action="store_true", help="one layer and one active set, called "
                   "again and again: the bundles stay in cache, so the kernels' arithmetic alone")
    p.add_argument("--fire", type=float, help="ReGLU (ReLU gates) with this share of the gates "
                   "firing, as kernels.py --kind reglu --fire; default: SwiGLU")
    args = p.parse_args()
    new_isa = args.new_isa or args.isa
    old = build_rev(args.rev) if args.rev else args.new if args.same else args.old
    new = args.new
    if old.is_file() and new.is_file() and old.read_bytes() == new.read_bytes():
        if new_isa == args.isa:
            raise SystemExit(f"{old} and {new} are the same bytes and --isa: nothing to compare "
                             f"(is sparseinfer installed from another tree? it is "
                             f"{sparseinfer.__file__})")
        tmp = Path(tempfile.mkdtemp(prefix="ab_kernels_"))  # its own copy: its own pool and ISA
        atexit.register(shutil.rmtree, tmp, True)
        new = Path(shutil.copy(new, tmp / "new.so"))
    libs = {"old": load(old, args.isa, args.threads), "new": load(new, new_isa, args.threads)}
    versions = {name: lib.si_abi_version() for name, lib in libs.items()}
    if versions["old"] != versions["new"] and sorted(versions.values()) != [Q4_ROWS_ABI - 1,
                                                                            Q4_ROWS_ABI]:
        raise SystemExit(f"the two libraries' ABI versions differ ({versions}): their calls may "
                         "not take the same arguments")
    isas = args.isa if new_isa == args.isa else f"old {args.isa}, new {new_isa}"
    print(f"# CPU: {cpu_model()}; kernels: {isas}; {args.threads} threads; old {old}; "
          f"new {args.new}")
    for type_name in args.gemv or []:
        run_gemv(libs, type_name, args.rounds, args.per_block, args.hot, args.rows_of_x)
    for panel in args.pack or []:
        run_pack(libs, panel, args.rounds, args.per_block)
    for name in [] if args.gemv or args.pack else args.dtypes:
        dtype, block = {"q4": ("q4", 0), "int8/row": ("int8", 0), "int8/32": ("int8", 32),
                        "q4-gates": ("q4", 0), "q4g": ("int8", 32), "q4i8": ("int8", 32)}[name]
        if name in ("q4g", "q4i8") and args.fire is None:
            p.error(f"--dtypes {name}: a ReLU gate's rows; expected --fire")
        run(libs, dtype, block, args.rounds, args.per_block, args.fire, name == "q4-gates",
            args.hot, name if name in ("q4g", "q4i8") else "")


if __name__ == "__main__":
    main()
