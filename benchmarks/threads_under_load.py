"""Decode speed with one core taken by another busy process: thread counts and wait policies.

    python benchmarks/threads_under_load.py                 # 3 rounds, -n 48, greedy
    python benchmarks/threads_under_load.py --rounds 2 --no-busy
    python benchmarks/threads_under_load.py --idle-cpu        # the mechanism, without a model
    python benchmarks/threads_under_load.py --train PROFILE   # predictor training (convert)

Each configuration runs `python -m sparseinfer run -n N --temp 0` in a fresh process (the wait
policy of an OpenMP pool is read once, when the pool starts) while a `while True: pass` process
spins; configurations alternate within each round so the machine's other load hits them alike.
Printed: the decode tokens/s of every run and each configuration's median, and its ratio to
`-t 1`. Compare the ratios of one run, not absolute figures across runs.

`--idle-cpu` measures what a waiting pool costs: 2-thread torch matmuls separated by 2 ms
sleeps, CPU seconds per wall second of the process, with the policy set in the environment at
start or by `sparseinfer.threads.passive_wait()` at run time (as the CLI does).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

PROMPT = "It is a truth universally acknowledged, that a single man in possession of"

# (label, -t, extra environment): OMP_WAIT_POLICY is set explicitly in every row so the
# measurement does not depend on the default the CLI applies.
CONFIGS = [
    ("-t 1", 1, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("-t 2, active wait (old default)", 2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ("-t 2, libgomp default wait", 2, {"OMP_WAIT_POLICY": ""}),
    ("-t 2, passive wait", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("-t 2, passive, GOMP_SPINCOUNT=10000", 2,
     {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}),
    ("-t 2, passive, GOMP_SPINCOUNT=50000", 2,
     {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "50000"}),
    ("-t auto (the CLI's default)", 0, {}),
]


def decode_rate(threads: int, env_extra: dict, n: int, every: dict) -> float:
    env = {**os.environ, **every}
    for k, v in env_extra.items():
        if v:
            env[k] = v
        else:
            env.pop(k, None)
    cmd = [sys.executable, "-m", "sparseinfer", "run", "-p", PROMPT, "-n", str(n), "--temp", "0",
           "--ignore-eos"]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    # llama.cpp's timing lines: "       eval time = ... (... ms per token, R tokens per second)"
    m = re.search(r"^\s*eval time\s*=.*?([0-9.]+) tokens per second\)", out.stderr, re.M)
    if not m:
        raise RuntimeError(f"no 'eval time' line in: {out.stderr[-500:]}")
    return float(m.group(1))


IDLE_PROBE = """
import os, sys, time, resource
if sys.argv[1] == "runtime":
    from sparseinfer.threads import passive_wait
    passive_wait()
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
for _ in range(200):
    a @ a
    time.sleep(0.002)
c1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
print((c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime) / (t1 - t0))
"""


def idle_cpu() -> None:
    rows = [("OMP_WAIT_POLICY unset (libgomp default)", "env", ""),
            ("OMP_WAIT_POLICY=ACTIVE", "env", "ACTIVE"),
            ("OMP_WAIT_POLICY=PASSIVE", "env", "PASSIVE"),
            ("passive_wait() at run time (the CLI)", "runtime", "")]
    for label, how, policy in rows:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        vals = [float(subprocess.run([sys.executable, "-c", IDLE_PROBE, how], env=env,
                                     capture_output=True, text=True, check=True).stdout)
                for _ in range(3)]
        print(f"{label:42s} CPU s per wall s: {statistics.median(vals):.2f} "
              f"(runs {', '.join(f'{v:.2f}' for v in vals)})")


TRAIN_PROBE = """
import sys, time
import torch
from sparseinfer.offline.profile import load_profile
from sparseinfer.offline.train import TrainOptions, train_predictors
torch.set_num_threads(int(sys.argv[2]))
prof = load_profile(sys.argv[1])
t0 = time.perf_counter()
p = train_predictors(prof, TrainOptions(ranks=(16,), min_steps=400), layers=[5]).layers[0]
print(time.perf_counter() - t0, p.recall, p.pred_density)
"""


def train_times(profile: str, rounds: int) -> None:
    """One layer's predictor (rank 16, 400 steps) per wait policy and thread count."""
    rows = [("2 threads, OMP_WAIT_POLICY unset (before)", "", 2),
            ("2 threads, OMP_WAIT_POLICY=ACTIVE", "ACTIVE", 2),
            ("2 threads, OMP_WAIT_POLICY=PASSIVE (now)", "PASSIVE", 2),
            ("1 thread", "PASSIVE", 1)]
    times: dict[str, list[float]] = {r[0]: [] for r in rows}
    for r in range(rounds):
        for label, policy, t in rows:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, "-c", TRAIN_PROBE, profile, str(t)], env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            times[label].append(float(out[0]))
            print(f"round {r + 1} {label:44s} {float(out[0]):6.1f} s  recall {float(out[1]):.4f}"
                  f"  density {float(out[2]):.3f}", flush=True)
    for label, _, _ in rows:
        print(f"{label:44s} median {statistics.median(times[label]):6.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--no-busy", action="store_true", help="no competing busy process")
    ap.add_argument("--idle-cpu", action="store_true", help="only the idle-pool CPU probe")
    ap.add_argument("--train", metavar="PROFILE", help="only predictor training on a profile "
                                                       "directory (`sparseinfer profile -o DIR`)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in every run's environment, e.g. SPARSEINFER_C_KERNELS=0 (torch's "
                         "and numba's kernels, whose OpenMP pools do the work)")
    args = ap.parse_args()
    every = dict(kv.split("=", 1) for kv in args.env)
    if args.idle_cpu:
        idle_cpu()
        return
    if args.train:
        train_times(args.train, args.rounds)
        return
    busy = None if args.no_busy else subprocess.Popen(
        [sys.executable, "-c", "while True: pass"])
    rates: dict[str, list[float]] = {label: [] for label, _, _ in CONFIGS}
    try:
        for r in range(args.rounds):
            for label, t, env in CONFIGS:
                rate = decode_rate(t, env, args.n, every)
                rates[label].append(rate)
                print(f"round {r + 1} {label:40s} {rate:7.2f} tok/s", flush=True)
    finally:
        if busy is not None:
            busy.kill()
    base = statistics.median(rates["-t 1"])
    print(f"\nos.cpu_count()={os.cpu_count()}, busy process: {not args.no_busy}, "
          f"median of {args.rounds} rounds, -n {args.n}, environment {every or 'as is'}")
    for label, _, _ in CONFIGS:
        med = statistics.median(rates[label])
        print(f"{label:40s} {med:7.2f} tok/s  {med / base:5.2f}x -t 1")


if __name__ == "__main__":
    main()
