"""Density → perplexity for magnitude sparsity (SwiGLU / GeGLU): the oracle-mask FFN.

    python benchmarks/quality.py [-m MODEL] [--densities 0.3,0.4,...]
                                 [--scores gate,output,output_norm]
                                 [--calib-tokens 4096] [--chunks 16] [-c 512] [--sparse FILE.gguf]

For each score (see sparseinfer/offline/calibrate.py) per-layer thresholds are calibrated on the
default corpus (Emma) for every density; perplexity is then measured on the held-out text
(Sense and Sensibility) with each FFN keeping only the neurons whose score exceeds its layer's
threshold (an oracle mask: what a perfect predictor would select). The achieved density on the
held-out text is printed beside the target. The default ``--target-density`` of ``convert`` is
the lowest density whose perplexity cost stays within 3% for the default score.

``--sparse FILE.gguf`` also measures a converted file with its trained predictors selecting the
neurons (fc2 · relu(fc1 · x) + fc2.bias >= powerinfer.sparse_threshold) — the quality the sparse
runtime delivers — alongside the file's own oracle thresholds.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from sparseinfer.data import DEFAULT_CORPUS, HELDOUT_TEXT, default_model_path
from sparseinfer.models.loading import load_model
from sparseinfer.offline.calibrate import (SCORES, ScoreHistogram, down_norms, hooked_ffns,
                                           neuron_scores, oracle_sparsity, run_chunks)
from sparseinfer.offline.profile import corpus_chunks, read_corpus
from sparseinfer.perplexity import perplexity


def score_histograms(model, chunks, scores) -> dict[str, ScoreHistogram]:
    """One pass over the calibration chunks fills a histogram per score."""
    hists = {s: ScoreHistogram(model.cfg.n_layers) for s in scores}
    norms = {}

    def record(i, ffn, x, h):
        if i not in norms:
            norms[i] = down_norms(ffn)
        for s, hist in hists.items():
            hist.add(i, neuron_scores(ffn, x, h, s, norms[i]))

    with hooked_ffns(model, record):
        run_chunks(model, chunks)
    return hists


def ppl(model, ids, n_ctx, bos, chunks):
    return perplexity(model, ids, n_ctx, bos, chunks).ppl


@torch.inference_mode()
def predictor_masks(lm):
    """A hooked_ffns callback that keeps the neurons a converted file's predictors select."""
    thr = float(lm.metadata.get("powerinfer.sparse_threshold", 0.0))
    ex = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in lm.extras.items()
          if k.endswith((".fc1.weight", ".fc2.weight", ".fc2.bias"))}
    dens: dict[int, list[float]] = {}

    def mask(i, ffn, x, h):
        fc1, fc2 = ex[f"blk.{i}.fc1.weight"], ex[f"blk.{i}.fc2.weight"]
        logits = torch.relu(x.float() @ fc1.T) @ fc2.T
        if f"blk.{i}.fc2.bias" in ex:
            logits = logits + ex[f"blk.{i}.fc2.bias"]
        keep = logits >= thr
        dens.setdefault(i, []).append(float(keep.float().mean()))
        return h * keep

    return mask, dens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model (default: embedded SmolLM2)")
    ap.add_argument("--densities", default="0.3,0.4,0.5,0.6,0.7,0.8")
    ap.add_argument("--scores", default=",".join(SCORES))
    ap.add_argument("--calib-tokens", type=int, default=4096, help="Emma tokens for thresholds")
    ap.add_argument("--chunks", type=int, default=16, help="held-out chunks scored")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--max-cost", type=float, default=0.03, help="perplexity cost for the pick")
    ap.add_argument("--sparse", default=None, help="a converted GGUF: also measure its predictors")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    torch.set_num_threads(args.threads)

    lm = load_model(args.model or default_model_path())
    model, tok = lm.model, lm.tokenizer
    densities = [float(d) for d in args.densities.split(",") if d]  # "" skips the grid
    scores = args.scores.split(",")
    ids = tok.encode(HELDOUT_TEXT.read_text(), add_bos=False)
    bos = tok.bos_id if tok.add_bos else None
    n_chunks = min(args.chunks, len(ids) // args.ctx_size)
    print(f"model {lm.path.name} ({lm.config.ffn_kind}); held-out: {n_chunks} chunks of "
          f"{args.ctx_size} ({n_chunks * args.ctx_size // 2} scored tokens)")

    t0 = time.perf_counter()
    base = ppl(model, ids, args.ctx_size, bos, n_chunks)
    print(f"dense: PPL {base:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    calib = corpus_chunks(tok, read_corpus([DEFAULT_CORPUS]), args.ctx_size, args.calib_tokens)
    hists = score_histograms(model, calib, scores) if densities else {}
    rows = []
    for s in scores:
        for d in densities:
            t0 = time.perf_counter()
            dens: dict[int, list[float]] = {}
            with oracle_sparsity(model, hists[s].thresholds(d), s, dens):
                p = ppl(model, ids, args.ctx_size, bos, n_chunks)
            got = float(np.mean([np.mean(v) for v in dens.values()]))
            rows.append((s, d, got, p, p / base - 1))
            print(f"  {s:12s} target {d:.2f} held-out density {got:.3f}  PPL {p:8.4f}  "
                  f"cost {100 * (p / base - 1):+6.2f}%  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)

    print("\n| score | target density | held-out density | PPL | cost |")
    print("|---|---|---|---|---|")
    print(f"| dense | 1.00 | 1.000 | {base:.3f} | - |")
    for s, d, got, p, c in rows:
        print(f"| {s} | {d:.2f} | {got:.3f} | {p:.3f} | {100 * c:+.1f}% |")
    for s in scores if densities else ():
        ok = [d for s2, d, _, _, c in rows if s2 == s and c <= args.max_cost]
        pick = min(ok) if ok else None
        print(f"lowest density within {100 * args.max_cost:.0f}% for {s}: {pick}")

    if args.sparse:
        sp = load_model(args.sparse)
        sids = sp.tokenizer.encode(HELDOUT_TEXT.read_text(), add_bos=False)
        mask, dens = predictor_masks(sp)
        with hooked_ffns(sp.model, mask):
            p = ppl(sp.model, sids, args.ctx_size, bos, n_chunks)
        got = float(np.mean([np.mean(v) for v in dens.values()]))
        print(f"\n{args.sparse}: predictors: held-out density {got:.3f}  PPL {p:.4f}  "
              f"cost {100 * (p / base - 1):+.2f}%")
        from gguf import GGUFReader

        fields = GGUFReader(args.sparse).fields  # (the loader abbreviates long arrays)
        if fields["sparseinfer.sparsity.mode"].contents() == "magnitude":
            thr = fields["sparseinfer.sparsity.layer_thresholds"].contents()
            score = fields["sparseinfer.sparsity.score"].contents()
            dens = {}
            with oracle_sparsity(sp.model, thr, score, dens):
                p = ppl(sp.model, sids, args.ctx_size, bos, n_chunks)
            got = float(np.mean([np.mean(v) for v in dens.values()]))
            print(f"{args.sparse}: its oracle thresholds: held-out density {got:.3f}  "
                  f"PPL {p:.4f}  cost {100 * (p / base - 1):+.2f}%")


if __name__ == "__main__":
    main()
