"""Predictor training on a finished profile with and without rank probes (``TrainOptions.
probe_steps``): time, the ranks chosen and the predicted density per layer, same run.

    python -m sparseinfer profile -o /work/prof -t 2          # SmolLM2, the default corpus
    python benchmarks/train_probe.py /work/prof [--probe-steps 0 250] [-t 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from sparseinfer.bench import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="a profile directory (sparseinfer profile -o DIR)")
    ap.add_argument("--probe-steps", type=int, nargs="+", default=[0, 250])
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sparseinfer.offline.profile import load_profile
    from sparseinfer.offline.train import TrainOptions, train_predictors

    prof = load_profile(args.profile)
    print(f"CPU: {cpu_model()}, {args.threads} threads, {prof.n_layers} layers, "
          f"{prof.n_tokens} tokens")
    runs = {}
    for steps in args.probe_steps:
        t0 = time.perf_counter()
        preds = train_predictors(prof, TrainOptions(probe_steps=steps))
        secs = time.perf_counter() - t0
        runs[steps] = preds
        dens = np.array([p.pred_density for p in preds.layers])
        print(f"probe_steps {steps:4d}: {secs:6.1f} s, ranks {[p.rank for p in preds.layers]}, "
              f"mean predicted density {dens.mean():.4f}, mean recall "
              f"{np.mean([p.recall for p in preds.layers]):.4f}")
    first, *rest = args.probe_steps
    for steps in rest:
        a, b = runs[first].layers, runs[steps].layers
        same = sum(p.rank == q.rank for p, q in zip(a, b))
        diff = max(abs(p.pred_density - q.pred_density) for p, q in zip(a, b))
        print(f"probe_steps {steps} against {first}: the same rank on {same} of {len(a)} layers, "
              f"predicted density at most {diff:.4f} apart")


if __name__ == "__main__":
    main()
