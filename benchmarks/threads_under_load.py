"""Decode speed with one core taken by another busy process: thread counts and wait policies.

    python benchmarks/threads_under_load.py                 # 3 rounds, -n 48, greedy
    python benchmarks/threads_under_load.py --rounds 2 --no-busy

Each configuration runs `python -m sparseinfer run -n N --temp 0` in a fresh process (the wait
policy of an OpenMP pool is read once, when the pool starts) while a `while True: pass` process
spins; configurations alternate within each round so the machine's other load hits them alike.
Printed: the decode tokens/s of every run and each configuration's median, and its ratio to
`-t 1`. Compare the ratios of one run, not absolute figures across runs.
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
    ("-t auto (new default)", 0, {}),
]


def decode_rate(threads: int, env_extra: dict, n: int) -> float:
    env = dict(os.environ)
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
    m = re.search(r"generation:.*\(\s*([0-9.]+) tokens/s\)", out.stderr)
    if not m:
        raise RuntimeError(f"no generation line in: {out.stderr[-500:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--no-busy", action="store_true", help="no competing busy process")
    args = ap.parse_args()
    busy = None if args.no_busy else subprocess.Popen(
        [sys.executable, "-c", "while True: pass"])
    rates: dict[str, list[float]] = {label: [] for label, _, _ in CONFIGS}
    try:
        for r in range(args.rounds):
            for label, t, env in CONFIGS:
                rate = decode_rate(t, env, args.n)
                rates[label].append(rate)
                print(f"round {r + 1} {label:36s} {rate:7.2f} tok/s", flush=True)
    finally:
        if busy is not None:
            busy.kill()
    base = statistics.median(rates["-t 1"])
    print(f"\nos.cpu_count()={os.cpu_count()}, busy process: {not args.no_busy}, "
          f"median of {args.rounds} rounds, -n {args.n}")
    for label, _, _ in CONFIGS:
        med = statistics.median(rates[label])
        print(f"{label:36s} {med:7.2f} tok/s  {med / base:5.2f}x -t 1")


if __name__ == "__main__":
    main()
