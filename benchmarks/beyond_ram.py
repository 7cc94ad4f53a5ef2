"""Beyond RAM: a sparse model under a real memory limit, against llama.cpp under the same limit.

    python benchmarks/beyond_ram.py --sparse /work/r7b/sparse.gguf --dense /work/r7b/dense.gguf
    python benchmarks/beyond_ram.py ... --fractions 0.75,0.5,0.3 -n 12 --eviction lru,freq
    python benchmarks/beyond_ram.py --sparse A.gguf B.gguf ...   # several bundled layouts
    python benchmarks/beyond_ram.py ... --read-mbps 280          # on a disk of 280 MB/s
    python benchmarks/beyond_ram.py ... --gates-apart both       # gates first beside bundles

Several ``--sparse`` files (the same model bundled in neuron order and in co-activation order,
``python -m sparseinfer.disk bundle --profile``) run side by side, labelled by their
``sparseinfer.bundle.order``. ``--gates-apart`` bundles each with the gate rows apart too
(``python -m sparseinfer.disk bundle --gates-apart``: a ReLU-gated FFN reads up and down rows only
for the neurons whose gate fired) and runs that layout (``only``) or both (``both``). At the
middle limit each layout also runs without the look-ahead
prefetch and with reads that never pass over unwanted rows (``DiskOptions.read_gap`` 0).

For each limit (a fraction of the dense Q4_0 file's size) every engine runs in its own process
inside a cgroup v1 memory group (``/sys/fs/cgroup/memory/NAME``, ``memory.limit_in_bytes``: it
counts the page cache, so neither engine can hide in cached file pages; needs root). Before each
run both files are dropped from the page cache (``posix_fadvise(DONTNEED)``), so pages cached
outside the group cannot serve it either. Reported per run: decode tokens/s, bytes read from the
disk per token (``/proc/self/io`` read_bytes over the decode: page faults of a mapped file and
O_DIRECT reads alike), the cgroup's peak usage and, for ours, the neuron cache's hit rate and
the look-ahead prefetch's precision. Ours runs with ``--ram-budget`` equal to the limit (or a
share of it: ``--budget-share``); the sparse file is bundled first (``python -m sparseinfer.disk
bundle``) if it is not.

Also measured and printed: the disk's O_DIRECT random-read throughput at 4, 16 and 64 KiB, one
read at a time and 8 in flight, and sequential 1 MiB reads. ``--read-mbps`` puts every run (the
probe too) in a cgroup v1 blkio group whose reads from the files' disk are throttled to that
rate: the disk issue 13 was written for (~280 MB/s) on a machine whose disk is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife.")
CGROOT = Path("/sys/fs/cgroup/memory")
BLKROOT = Path("/sys/fs/cgroup/blkio")


# ---- the disk -------------------------------------------------------------------------------------


def disk_throughput(path: Path, seconds: float = 2.0) -> list[dict]:
    """O_DIRECT reads of ``path`` at random aligned offsets (and sequential 1 MiB reads)."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    out = []

    def worker(block: int, sequential: bool, deadline: float) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, block)
        rng = random.Random(block ^ os.getpid() ^ int(deadline * 1e6))
        n, off = 0, rng.randrange(0, size - block) // 4096 * 4096
        try:
            while time.perf_counter() < deadline:
                if not sequential:
                    off = rng.randrange(0, size - block) // 4096 * 4096
                n += os.preadv(fd, [buf], off)
                off = (off + block) % (size - block) // 4096 * 4096 if sequential else off
        finally:
            os.close(fd)
        return n

    for block, depth, seq in [(4096, 1, False), (4096, 8, False), (16384, 1, False),
                              (16384, 8, False), (65536, 1, False), (65536, 8, False),
                              (1 << 20, 1, True)]:
        if size < 4 * block:
            continue
        deadline = time.perf_counter() + seconds
        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            total = sum(pool.map(lambda _: worker(block, seq, deadline), range(depth)))
        dt = time.perf_counter() - t0
        out.append({"block_kib": block // 1024, "in_flight": depth, "sequential": seq,
                    "MB_s": total / dt / 1e6, "iops": total / block / dt})
    return out


# ---- one engine in a memory group -----------------------------------------------------------------


def drop_cache(*paths: Path) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_device(path: Path) -> str:
    """"major:minor" of the whole disk holding ``path`` (blkio throttles disks, not partitions)."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (sys_dev / "partition").exists():
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def run_limited(job: dict, limit: int | None, timeout: float,
                read_bps: int | None = None) -> dict:
    """``job`` in a child process inside a fresh cgroup limited to ``limit`` bytes (None: no
    limit) and, with ``read_bps``, a blkio group whose reads from the file's disk are throttled
    to that many bytes/s (page faults and O_DIRECT reads alike); the child's JSON result plus
    the memory group's peak usage and failures."""
    name = f"sparseinfer-beyond-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    group, blk = CGROOT / name, BLKROOT / name
    drop_cache(Path(job["path"]), *[Path(p) for p in job.get("drop", [])])
    if limit is not None:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    if read_bps is not None:
        blk.mkdir()
        (blk / "blkio.throttle.read_bps_device").write_text(
            f"{disk_device(Path(job['path']))} {read_bps}")

    def join():
        if limit is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        if read_bps is not None:
            (blk / "cgroup.procs").write_text(str(os.getpid()))

    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=join)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            killed = p.returncode in (-9, 137)
            res = {"error": "killed (out of memory)" if killed else
                   f"exit {p.returncode}: {err}"}
        else:
            res = json.loads(lines[-1])
    except subprocess.TimeoutExpired:
        res = {"error": f"no answer in {timeout:.0f} s"}
    finally:
        if limit is not None:
            try:
                res["peak_MiB"] = int((group / "memory.max_usage_in_bytes").read_text()) / 2**20
                res["failcnt"] = int((group / "memory.failcnt").read_text())
            except (OSError, ValueError):
                pass
        for g, made in ((group, limit is not None), (blk, read_bps is not None)):
            for _ in range(50 if made else 0):  # a group empties when the child is gone
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    return res


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def child_ours(job: dict) -> dict:
    from sparseinfer.config import SamplingParams
    from sparseinfer.disk.plan import DiskOptions
    from sparseinfer.disk.tier import disk_report, reset_disk_stats
    from sparseinfer.engine import Engine

    t0 = time.perf_counter()
    opts = {}
    if job["budget"] is not None:
        opts = {"ram_budget": job["budget"] / 2**30,
                "disk_options": DiskOptions(eviction=job["eviction"], prefetch=job["prefetch"],
                                            read_gap=job.get("read_gap"),
                                            io_threads=job["io_threads"])}
    e = Engine.load(job["path"], n_ctx=job["ctx"], threads=job["threads"], **opts)
    t_load = time.perf_counter() - t0
    ids = e.encode(PROMPT)
    params = SamplingParams(max_tokens=job["tokens"], temperature=0.0, ignore_eos=True)
    times, io0 = [], 0
    t_prev = time.perf_counter()
    for ev in e.stream(ids, params):
        if getattr(ev, "token_id", -1) < 0:
            continue
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        if len(times) == 1:  # prefill done: count the decode only
            reset_disk_stats(e.model)
            io0 = _read_bytes()
    io = _read_bytes() - io0
    n = len(times) - 1
    out = {"engine": "sparseinfer", "load_s": t_load, "prefill_s": times[0],
           "decode_tok_s": n / sum(times[1:]), "disk_MB_per_token": io / n / 1e6,
           "density": e.sparse_info.density() if e.sparse_info else None}
    rep = disk_report(e.model)
    reader = getattr(e.model, "_disk_reader", None)
    if reader is not None:
        out["read_gap"] = reader.max_gap  # DiskOptions.read_gap, or measured at load
    if rep is not None:
        dp = e.loaded.plan.sparse.disk
        out.update(reader_MB_per_token=rep.bytes_read / n / 1e6,
                   reads_per_token=rep.reads / n,
                   cache_hit_rate=rep.cache.hit_rate,
                   prefetch_precision=rep.prefetch_precision,
                   prefetch_share=((rep.cache.prefetch_hits / rep.cache.requested)
                                   if rep.cache.requested else None),
                   ram_neurons=sum(dp.ram_counts) if dp else None,
                   cache_slots=dp.cache_slots if dp else None,
                   budget_parts_MiB={k: round(v / 2**20) for k, v in dp.parts} if dp else None)
    return out


def child_llama(job: dict) -> dict:
    from llama_cpp import Llama
    from llama_cpp import llama_cpp

    if not job.get("repack", True):
        # llama.cpp repacks Q4_0 weights into anonymous memory on AVX-512/AVX2 CPUs (its "extra
        # buffer types"): a copy of the whole model outside the mapped file, which no memory
        # limit below the file's size survives. Off: the weights stay in the map, as on a CPU
        # without repacking.
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = Llama(job["path"], n_threads=job["threads"], n_threads_batch=job["threads"], n_ctx=job["ctx"], verbose=False)
    t_load = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode())
    llm.reset()
    llm.eval(ids)
    io0 = _read_bytes()
    t0 = time.perf_counter()
    n = job["tokens"] - 1
    for _ in range(n):
        llm.eval([llm.sample(temp=0.0)])
    dt = time.perf_counter() - t0
    io = _read_bytes() - io0
    return {"engine": "llama.cpp", "load_s": t_load, "decode_tok_s": n / dt,
            "disk_MB_per_token": io / n / 1e6}


# ---- main -----------------------------------------------------------------------------------------


def main() -> int:
    from sparseinfer.disk.plan import DiskOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sparse", type=Path, nargs="+",
                    help="sparse GGUFs (bundled or not; several: bundle orders side by side)")
    ap.add_argument("--dense", type=Path, help="the dense Q4_0 GGUF it was converted from")
    ap.add_argument("--fractions", default="0.75,0.5,0.3",
                    help="memory limits as fractions of the dense file's size")
    ap.add_argument("--eviction", default="lru,freq", help="cache evictions to run")
    ap.add_argument("--no-prefetch-run", action="store_true",
                    help="skip the runs without prefetch and without gap reads (at the middle "
                         "limit)")
    ap.add_argument("-n", "--tokens", type=int, default=12)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--llama-repack", default="on,off",
                    help="llama.cpp runs with its weight repacking on and/or off")
    ap.add_argument("--unlimited", action="store_true", help="also run both without a limit")
    ap.add_argument("--io-threads", default=str(DiskOptions.io_threads),
                    help="ours: reads in flight (DiskOptions.io_threads), comma-separated: each "
                         "is a run")
    ap.add_argument("--read-mbps", type=float, default=None,
                    help="throttle every run's reads from the files' disk to this many MB/s "
                         "(a cgroup v1 blkio group): a slower disk than this machine's, e.g. 280")
    ap.add_argument("--budget-share", default="1",
                    help="ours: --ram-budget as shares of the limit, comma-separated: each is a "
                         "run (below 1 leaves the kernel room under the limit)")
    ap.add_argument("--read-gap", type=int, default=None,
                    help="ours: unwanted rows a read may pass over (DiskOptions.read_gap) in every "
                         "run; default: measured at load. Under --read-mbps the measurement "
                         "sees the throttle's slack (a 280 MB/s throttle timed at ~400-800 MB/s "
                         "for short bursts: gap 8 where a 280 MB/s disk gives 0)")
    ap.add_argument("--gates-apart", choices=("no", "only", "both"), default="no",
                    help="bundle each sparse file with its gate rows apart too and run that "
                         "layout instead of (only) or beside (both) the plain bundles")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        if job["engine"] == "disk":
            res = {"disk": disk_throughput(Path(job["path"]))}
        else:
            res = child_ours(job) if job["engine"] == "ours" else child_llama(job)
        print(json.dumps(res))
        return 0

    from sparseinfer.bench import cpu_model
    from sparseinfer.disk.layout import Q4_LAYOUT, Q4_LAYOUT_KEY, bundle_file, is_bundled
    from sparseinfer.models.loading import open_source

    if os.geteuid() != 0 or not CGROOT.is_dir():
        print("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory",
              file=sys.stderr)
        return 1
    layouts = {}  # label -> bundled file
    kinds = {"no": [False], "only": [True], "both": [False, True]}[args.gates_apart]
    for sparse in args.sparse:
        for apart in kinds:
            path = sparse
            if apart or not is_bundled(open_source(sparse)):
                if is_bundled(open_source(sparse)):
                    print(f"{sparse} is bundled already: --gates-apart needs the sparse file it "
                          f"was bundled from", file=sys.stderr)
                    return 1
                path = sparse.with_name(sparse.stem + (".gates" if apart else ".bundled")
                                        + ".gguf")
                if path.exists() and open_source(path).metadata.get(Q4_LAYOUT_KEY) != Q4_LAYOUT:
                    print(f"{path}: bundled by an older sparseinfer (Q4_0 blocks): bundling "
                          f"again", file=sys.stderr)
                    path.unlink()
                if not path.exists():
                    t0 = time.perf_counter()
                    bundle_file(sparse, path, "q4", gates_apart=apart)
                    print(f"bundled {sparse} -> {path} in {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr)
            order = str(open_source(path).metadata.get("sparseinfer.bundle.order", "neuron"))
            label = "ours" + (f" {order}" if len(args.sparse) > 1 else "") + (
                " gates first" if apart else "")
            layouts[label] = path
    dense_size = args.dense.stat().st_size
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.2f} (a busy machine: other "
          f"jobs share it); {args.threads} threads, {args.tokens} tokens, ctx {args.ctx}")
    print(f"dense {args.dense} {dense_size / 2**30:.2f} GiB; " + "; ".join(
        f"{k}: {p} {p.stat().st_size / 2**30:.2f} GiB" for k, p in layouts.items()))
    sparse_files = [str(p) for p in layouts.values()]
    read_bps = None if args.read_mbps is None else int(args.read_mbps * 1e6)
    if read_bps is not None and not BLKROOT.is_dir():
        print(f"--read-mbps needs cgroup v1's blkio controller at {BLKROOT}", file=sys.stderr)
        return 1
    biggest = max([*layouts.values(), args.dense], key=lambda p: p.stat().st_size)
    if read_bps is None:
        probe = disk_throughput(biggest)
        print("disk, O_DIRECT reads:")
    else:  # measured inside a throttled group, as the engines will read
        res = run_limited({"engine": "disk", "path": str(biggest)}, None, args.timeout, read_bps)
        if "disk" not in res:
            print(f"the throttled disk probe failed: {res.get('error')}", file=sys.stderr)
            return 1
        probe = res["disk"]
        print(f"disk, O_DIRECT reads, throttled to {args.read_mbps:g} MB/s (blkio "
              f"{disk_device(biggest)}):")
    for r in probe:
        kind = "sequential" if r["sequential"] else "random"
        print(f"  {kind:10s} {r['block_kib']:5d} KiB x{r['in_flight']}: {r['MB_s']:7.1f} MB/s "
              f"({r['iops']:.0f} reads/s)")
    rows = []
    fractions = [float(f) for f in args.fractions.split(",") if f]
    limits = ([None] if args.unlimited else []) + fractions
    evictions = [e for e in args.eviction.split(",") if e]
    io_threads = [int(n) for n in args.io_threads.split(",") if n]
    shares = [float(f) for f in args.budget_share.split(",") if f]
    middle = fractions[len(fractions) // 2] if fractions else None
    for frac in limits:
        limit = None if frac is None else int(frac * dense_size)
        base = {"ctx": args.ctx, "threads": args.threads, "tokens": args.tokens}
        runs = []
        for name, sparse in layouts.items() if not args.no_ours else []:
            ours = {**base, "engine": "ours", "path": str(sparse),
                    "drop": [str(args.dense), *sparse_files], "budget": limit,
                    "read_gap": args.read_gap, "io_threads": io_threads[0]}
            for ev in evictions:
                for io in io_threads:
                    for share in shares if limit is not None else [1.0]:
                        runs.append(({**ours, "eviction": ev, "prefetch": True, "io_threads": io,
                                      "budget": None if limit is None else int(share * limit)},
                                     f"{name} {ev}" + (f" io {io}" if len(io_threads) > 1 else "")
                                     + (f" budget {share:.0%}" if len(shares) > 1 else "")))
                if limit is None:
                    break
            if frac == middle and not args.no_prefetch_run:
                runs.append(({**ours, "eviction": evictions[0], "prefetch": False},
                             f"{name} {evictions[0]} no prefetch"))
                if args.read_gap != 0:
                    runs.append(({**ours, "eviction": evictions[0], "prefetch": True,
                                  "read_gap": 0}, f"{name} {evictions[0]} no gap reads"))
        for rp in args.llama_repack.split(",") if not args.no_llama_cpp else []:
            runs.append(({**base, "engine": "llama", "path": str(args.dense),
                          "drop": sparse_files, "repack": rp == "on"},
                         "llama.cpp" + (" no repack" if rp == "off" else "")))
        for job, label in runs:
            res = run_limited(job, limit, args.timeout, read_bps)
            res.update(label=label, limit_GiB=None if limit is None else limit / 2**30,
                       fraction=frac)
            rows.append(res)
            print(json.dumps(res), file=sys.stderr)
    print(f"\n{'limit':>12s} {'engine':34s} {'tok/s':>8s} {'disk MB/tok':>12s} "
          f"{'reads/tok':>10s} {'hit rate':>9s} {'prefetch':>9s} {'peak MiB':>9s} {'gap':>4s}")
    for r in rows:
        lim = "none" if r["fraction"] is None else f"{r['fraction']:.0%} {r['limit_GiB']:.2f}G"
        if "error" in r:
            print(f"{lim:>12s} {r['label']:34s} {r['error']}")
            continue
        hr = r.get("cache_hit_rate")
        pp = r.get("prefetch_precision")
        rt = r.get("reads_per_token")
        print(f"{lim:>12s} {r['label']:34s} {r['decode_tok_s']:8.3f} "
              f"{r['disk_MB_per_token']:12.1f} {'' if rt is None else f'{rt:.0f}':>10s} "
              f"{'' if hr is None else f'{hr:.1%}':>9s} "
              f"{'' if pp is None else f'{pp:.1%}':>9s} {r.get('peak_MiB', float('nan')):9.0f} "
              f"{r.get('read_gap', ''):>4}")
    for frac in fractions:
        ours = [r for r in rows if r["fraction"] == frac and r["label"].startswith("ours")
                and "error" not in r]
        ll = [r for r in rows if r["fraction"] == frac and r["label"].startswith("llama.cpp")
              and "error" not in r]
        if ours and ll:
            best = max(ours, key=lambda r: r["decode_tok_s"])
            lb = max(ll, key=lambda r: r["decode_tok_s"])
            print(f"at {frac:.0%}: {best['label']} {best['decode_tok_s'] / lb['decode_tok_s']:.1f}x "
                  f"{lb['label']}'s tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
