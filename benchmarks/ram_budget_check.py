"""Does a ``--ram-budget`` hold? Load a bundled sparse file with a budget, outside any cgroup,
and print what the process holds (``/proc/self/status``: VmRSS, its peak VmHWM, RssAnon,
RssFile) after the load and after each decoded token, beside the plan's parts.

    python benchmarks/ram_budget_check.py /work/r13b/sparse.bundled.gguf 5.185 -n 6

VmRSS counts the mapped weights' pages and library code (RssFile) as well as anonymous memory;
a cgroup limit counts the same pages (and the page cache of files read without O_DIRECT).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from beyond_ram import PROMPT  # the same prompt as the limited runs (benchmarks/ is on sys.path)


def status() -> dict[str, int]:
    """MiB of the process's memory lines in /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a bundled sparse GGUF (python -m sparseinfer.disk bundle)")
    ap.add_argument("budget", type=float, help="--ram-budget in GiB")
    ap.add_argument("-n", "--tokens", type=int, default=6)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=128)
    args = ap.parse_args()

    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine
    from sparseinfer.threads import passive_wait

    passive_wait()
    e = Engine.load(args.model, n_ctx=args.ctx, threads=args.threads, ram_budget=args.budget)
    parts = dict(e.loaded.plan.sparse.disk.parts)
    budget = int(args.budget * 2**30)
    print(f"budget {budget / 2**20:.0f} MiB: "
          + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in parts.items()))
    print("loaded  ", status())
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for i, _ in enumerate(e.stream(e.encode(PROMPT), params)):
        print(f"token {i:2d}", status())
    st = status()
    print(f"VmRSS {st['VmRSS']} MiB, peak {st['VmHWM']} MiB, budget {budget / 2**20:.0f} MiB: "
          f"peak {st['VmHWM'] / (budget / 2**20):.3f}x the budget")


if __name__ == "__main__":
    main()
