"""One prompt chunk through the layers (``model.hidden``, no LM head) per weight dtype: what the
profile of ``sparseinfer convert`` runs, chunk after chunk, and what a prompt costs.

    python benchmarks/prefill_chunk.py [-m MODEL] [--dtypes auto fp32] [-T 512] [-t 2]

Prints the CPU, then per dtype the best of ``--repeats`` runs in tokens/s and the ratio to the
first dtype, all measured in this run.
"""

from __future__ import annotations

import argparse
import time

import torch

from sparseinfer.bench import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF or HF directory (default SmolLM2)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp32"])
    ap.add_argument("-T", "--tokens", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sparseinfer.data import default_model_path
    from sparseinfer.models.loading import load_model

    print(f"CPU: {cpu_model()}, {args.threads} threads, {args.tokens}-token chunk")
    first = None
    for dtype in args.dtypes:
        lm = load_model(args.model or default_model_path(), dtype=dtype)
        cache = lm.model.new_cache(1, args.tokens)
        ids = torch.randint(0, lm.config.vocab_size, (1, args.tokens))
        best = float("inf")
        with torch.inference_mode():
            lm.model.hidden(ids, 0, cache)  # warm-up
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                lm.model.hidden(ids, 0, cache)
                best = min(best, time.perf_counter() - t0)
        rate = args.tokens / best
        first = first or rate
        print(f"{dtype:6s} {best:7.3f} s  {rate:7.1f} tok/s  {rate / first:5.2f}x")
        del lm, cache


if __name__ == "__main__":
    main()
