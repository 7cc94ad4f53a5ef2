"""Time the full offline conversion of SmolLM2-135M with the default corpus (target: < 15 min on
2 cores), print per-step times and the per-layer summary, and check the predictors on held-out
text (Sense and Sensibility, profiled with the file's own thresholds).

    python benchmarks/convert.py [-o OUT.gguf] [-t THREADS] [--max-tokens N] [--budget B]
                                 [--policy recall|density] [--heldout-tokens 2048] [--keep-work DIR]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sparseinfer.data import HELDOUT_TEXT
from sparseinfer.offline.calibrate import DEFAULT_SCORE, DEFAULT_TARGET_DENSITY
from sparseinfer.offline.pipeline import (Bars, ConvertOptions, convert, format_summary, load,
                                          parse_bytes)
from sparseinfer.offline.profile import (DEFAULT_MAX_TOKENS, ProfileOptions, corpus_chunks,
                                         profile_model, read_corpus)
from sparseinfer.offline.train import TrainOptions, evaluate_predictors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("-o", "--output", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--target-density", type=float, default=DEFAULT_TARGET_DENSITY)
    ap.add_argument("--score", default=DEFAULT_SCORE)
    ap.add_argument("--policy", default="recall", choices=("recall", "density"))
    ap.add_argument("--budget", default=None, help="fast-tier budget (default: none)")
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--keep-work", type=Path, default=None, help="keep the profile here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory(prefix="sparseinfer-bench-")
    out = args.output or Path(tmp.name) / "smollm2-sparse.gguf"
    options = ConvertOptions(
        profile=ProfileOptions(max_tokens=args.max_tokens, target_density=args.target_density,
                               score=args.score),
        train=TrainOptions(policy=args.policy),
        budget_bytes=None if args.budget is None else parse_bytes(args.budget),
        work_dir=args.keep_work, keep_work=args.keep_work is not None,
    )
    t0 = time.perf_counter()
    report = convert(args.model, out, options, Bars())
    total = time.perf_counter() - t0
    print(format_summary(report.profile, report.predictors, report.placement))
    print(f"\noutput: {report.output.path} ({report.output.n_bytes / 2**20:.1f} MiB)")
    print(f"threads {args.threads}; step times:")
    for step, s in report.seconds.items():
        print(f"  {step:8s} {s:8.1f} s")
    print(f"  {'total':8s} {total:8.1f} s  ({total / 60:.1f} min; target < 15 min)")

    # held-out check: profile Sense and Sensibility with the calibrated thresholds
    loaded = load(report.output.path)
    chunks = corpus_chunks(loaded.tokenizer, read_corpus([HELDOUT_TEXT]), 512,
                           args.heldout_tokens)
    # the exported model's neurons are permuted hot-first: its thresholds and predictors match
    t0 = time.perf_counter()
    held = profile_model(loaded.model, chunks, Path(tmp.name) / "heldout",
                         ProfileOptions(max_tokens=args.heldout_tokens, score=args.score,
                                        target_density=args.target_density),
                         thresholds=None if report.profile.mode == "relu"
                         else report.profile.thresholds)
    preds = _permuted(report.predictors, report.profile.freqs)
    rows = evaluate_predictors(preds, held)
    print(f"\nheld-out ({held.n_tokens} tokens of {HELDOUT_TEXT.name}, "
          f"{time.perf_counter() - t0:.0f} s):")
    print(f"{'layer':>5} {'true dens':>9} {'recall':>7} {'precision':>9} {'pred.dens':>9}")
    for l, (rec, prec, dens, true) in enumerate(rows):
        print(f"{l:5d} {true:9.3f} {rec:7.4f} {prec:9.3f} {dens:9.3f}")
    r = np.array(rows)
    print(f"{'all':>5} {r[:, 3].mean():9.3f} {r[:, 0].mean():7.4f} {r[:, 1].mean():9.3f} "
          f"{r[:, 2].mean():9.3f}")
    tmp.cleanup()


def _permuted(preds, freqs):
    """The predictors in the exported (hot-first) neuron order."""
    from dataclasses import replace

    from sparseinfer.offline.export import hot_first_permutations

    perms = hot_first_permutations(freqs)
    layers = tuple(replace(p, fc2=p.fc2[s], bias=p.bias[s])
                   for p, s in zip(preds.layers, perms))
    return replace(preds, layers=layers)


if __name__ == "__main__":
    main()
