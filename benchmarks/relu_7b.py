"""Sparse decode where PowerInfer lives: a Llama-2-7B-shaped ReGLU model, converted and run
sparse against our dense engine and llama.cpp on the same weights, in one run.

    python benchmarks/relu_7b.py --out /tmp/r7b                # 7B: write, convert, run
    python benchmarks/relu_7b.py --out /tmp/r7b --skip-convert # rerun the engines only
    python benchmarks/relu_7b.py --out /tmp/r1b --shape tinyllama  # TinyLlama-1.1B's shape
    python benchmarks/relu_7b.py --out /tmp/rtiny --shape tiny # a smoke run of every step

Leaves in ``--out``: ``dense.gguf`` (Q4_0, loads in llama.cpp and in ``sparseinfer run``) and
``sparse.gguf`` (what ``sparseinfer convert`` made of it), plus ``work/`` (the profile and the
predictors, so ``sparseinfer export`` can redo the last step).

The weights. No trained ReLU-family 7B model is on this machine, so the generator builds one
whose FFN activations are sparse and predictable by construction, in the way real ReLU models
are measured to be (PowerInfer, Deja Vu): each token's active set is a function of the layer
input, a few neurons fire on almost every token and most rarely. How:

- The residual stream carries a constant: dims 0..31 (one Q4_0 block, so it is stored exactly)
  of every embedding row are 1, and every projection writing to the residual (``attn_output``,
  ``ffn_down``) has zero rows there, so after RMSNorm those dims hold 1/rms of the token.
- Gate row i is  ``u_i · V`` (rank ``--gate-rank`` over the other dims) + ``s · n_i`` (full-rank
  noise, ``--noise``: what no low-rank predictor sees exactly) + an offset ``b_i / 32`` on each
  constant dim. ReGLU fires iff the gate is > 0, so ``b_i`` sets neuron i's firing rate f_i:
  ``b_i = -Φ⁻¹(1 - f_i) · sqrt(1 + s²)`` for unit-variance inputs (the condition is scale-free:
  RMSNorm scales signal and offset alike).
- Firing rates follow a power law  f_i ∝ rank^-α, capped at 0.99, with α chosen so that the
  20% most active neurons carry 80% of the activations (PowerInfer: 17–26% carry 80% in Llama and
  OPT) and the mean is ``--density``; neurons are shuffled (``convert`` sorts them hot-first).
- Embeddings are unit-variance elsewhere and lie near a subspace (``--embed-rank`` 256: 90% of
  their variance), as trained embeddings and hidden states are anisotropic. With isotropic
  N(0, 1) embeddings (``--embed-rank 0``) a profile of a few thousand tokens is too few samples
  for the predictors to find the gates' subspace in thousands of dimensions, and they select
  several times the true density (benchmarks/RESULTS.md, "Sparse decode at 7B").
- Attention and up/down are random, small where they write to the residual (so the layer
  inputs stay close to the embedding distribution and the rates hold at every depth). Matrices without structure (q, k, v, up, the head) repeat a few random
  blocks across layers: bytes decide speed, not values.

llama.cpp has no ReGLU llama, so it computes SwiGLU on these weights: the same bytes and the
same work per token, a different function. The text is meaningless either way; only speed,
memory and the measured density are reported (no perplexity is claimed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # d_model, d_ff, layers, heads, kv heads
    "7b": (4096, 11008, 32, 32, 32),
    "13b": (5120, 13824, 40, 40, 40),
    "tinyllama": (2048, 5632, 22, 32, 4),  # TinyLlama-1.1B (grouped K/V heads)
    "tiny": (256, 1024, 4, 4, 4),
}
CONST = 32  # constant dims of the residual stream: one Q4_0 block
PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife.")


def firing_rates(d_ff: int, density: float, rng, hot_share: float = 0.8, top: float = 0.2,
                 cap: float = 0.99) -> np.ndarray:
    """Per-neuron firing rates: a capped power law with mean ``density`` whose ``top`` most
    active neurons carry ``hot_share`` of all activations; shuffled."""
    ranks = np.arange(d_ff) + 1.0

    def rates(alpha):
        r = ranks ** -alpha
        lo, hi = 0.0, 1e6  # scale so the capped mean is ``density``
        for _ in range(80):
            a = (lo + hi) / 2
            lo, hi = (a, hi) if np.minimum(cap, a * r).mean() < density else (lo, a)
        return np.minimum(cap, lo * r)

    def share(alpha):
        f = rates(alpha)
        return f[: int(top * d_ff)].sum() / f.sum()

    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < hot_share else (lo, mid)
    return rng.permutation(rates(hi))


def write_model(path: Path, shape: str, density: float, gate_rank: int, noise: float,
                embed_rank: int = 0, layers: int = 0, seed: int = 0) -> dict:
    """The ReGLU model as a Q4_0 GGUF with SmolLM2's tokenizer; returns what was chosen."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as Q
    from scipy.stats import norm

    from sparseinfer.data import default_model_path
    from sparseinfer.offline.export import _copy_fields
    from sparseinfer.sparse.packed import quantize_q4_0

    D, F, L, H, KV = SHAPES[shape]
    L = layers or L
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    src = gguf.GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    hd = D // H

    def q4(t: torch.Tensor) -> np.ndarray:
        return quantize_q4_0(t).numpy()

    def tiled(rows: int, cols: int, std: float, zero_rows: int = 0, base: int = 512):
        """Q4_0 rows of N(0, std²) values: ``base`` random rows quantized once and repeated."""
        b = q4(torch.randn(min(base, rows), cols, generator=g) * std)
        out = np.ascontiguousarray(np.tile(b, (-(-rows // b.shape[0]), 1))[:rows])
        out[:zero_rows] = 0  # an all-zero Q4_0 block (scale 0) is exactly 0
        return out

    if embed_rank:  # token embeddings near a subspace, as trained ones are (anisotropic)
        basis = torch.linalg.qr(torch.randn(D, embed_rank, generator=g))[0] * math.sqrt(D / embed_rank)
        emb = (torch.randn(vocab, embed_rank, generator=g) @ basis.T) * 0.95 + torch.randn(
            vocab, D, generator=g) * math.sqrt(1 - 0.95**2)
    else:
        emb = torch.randn(vocab, D, generator=g)
    emb[:, :CONST] = 1.0
    emb = q4(emb)
    head = tiled(vocab, D, 1 / math.sqrt(D))
    wq = tiled(D, D, 1 / math.sqrt(D))
    wkv = tiled(KV * hd, D, 1 / math.sqrt(D))
    wo = tiled(D, D, 0.05 / math.sqrt(D), zero_rows=CONST)
    up = tiled(F, D, 1 / math.sqrt(D))
    down = tiled(D, F, 0.05 / math.sqrt(F * density), zero_rows=CONST)
    ones = np.ones(D, dtype=np.float32)
    rates = []

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random ReGLU llama-{shape}")
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_rope_dimension_count(hd)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(2)  # MOSTLY_Q4_0
    w.add_string("sparseinfer.ffn_kind", "reglu")
    _copy_fields(w, src, lambda k: k.startswith("tokenizer."))
    w.add_tensor("token_embd.weight", emb, raw_dtype=Q.Q4_0)
    for i in range(L):
        f = firing_rates(F, density, rng)
        b = -norm.ppf(1 - f) * math.sqrt(1 + noise**2)
        V = torch.randn(gate_rank, D - CONST, generator=g) / math.sqrt(D - CONST)
        U = torch.randn(F, gate_rank, generator=g) / math.sqrt(gate_rank)
        gate = torch.empty(F, D)
        gate[:, CONST:] = U @ V + torch.randn(F, D - CONST, generator=g) * (
            noise / math.sqrt(D - CONST))
        gate[:, :CONST] = torch.from_numpy(b / CONST).float()[:, None]
        rates.append(f)
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", wq, raw_dtype=Q.Q4_0)
        w.add_tensor(p + "attn_k.weight", wkv, raw_dtype=Q.Q4_0)
        w.add_tensor(p + "attn_v.weight", wkv, raw_dtype=Q.Q4_0)
        w.add_tensor(p + "attn_output.weight", wo, raw_dtype=Q.Q4_0)
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", q4(gate), raw_dtype=Q.Q4_0)
        w.add_tensor(p + "ffn_up.weight", up, raw_dtype=Q.Q4_0)
        w.add_tensor(p + "ffn_down.weight", down, raw_dtype=Q.Q4_0)
        del gate, U, V
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", head, raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    f = np.sort(np.stack(rates), axis=1)[:, ::-1]
    return {"designed_density": float(f.mean()),
            "top20_share": float(f[:, : F // 5].sum() / f.sum()),
            "neurons_over_half": float((f > 0.5).sum(axis=1).mean())}


# ---- the engines, each in its own process ------------------------------------------------------


def _peak_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# the sparse FFN rows --sparse-rows can ask for: Engine.load options (``run --ffn-dtype ...``)
SPARSE_ROWS = {"q4": {"ffn_dtype": "q4"},  # 4-bit bundles, the down rows rounded again
               "int8": {"ffn_dtype": "int8", "q4_gates": False},  # int8 bundles alone
               # + the file's gate rows apart
               "int8-q4-gates": {"ffn_dtype": "int8", "q4_gates": True, "q4_ups": False},
               # + its up rows as q4 rows too, beside the int8 down rows (dtype "q4i8")
               "q4i8": {"ffn_dtype": "int8", "q4_gates": True, "q4_ups": True}}


def _ours(path: str, threads: int, n_tokens: int, n_ctx: int, rows: str | None) -> dict:
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch and numba start their pools
    from sparseinfer import cpu
    from sparseinfer.bench import timed_split
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, FinishEvent, TokenEvent

    cpu.set_threads(threads)
    t0 = time.perf_counter()
    opts = SPARSE_ROWS[rows] if rows else {}
    engine = Engine.load(path, n_ctx=n_ctx, threads=threads, **opts)
    t_load = time.perf_counter() - t0
    ids = engine.encode(PROMPT)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    list(engine.stream(ids[:4], warm))
    engine.forget_prefix()  # the whole prompt is prefilled (and timed) below
    info = engine.sparse_info

    def selected() -> tuple[int, int]:  # neurons computed, neurons there were (all tokens)
        return (sum(m.stats.active for m in info.modules),
                sum(m.stats.tokens * m.d_ff for m in info.modules))

    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    at_first = None  # the counts once the prompt is in: the density is the decode steps' only
    for ev in engine.stream(ids, params):
        if info is not None and at_first is None and isinstance(ev, TokenEvent):
            at_first = selected()
        if isinstance(ev, FinishEvent):
            fin = ev
    gen_density = None
    if info is not None:
        active, total = selected()
        gen_density = (active - at_first[0]) / (total - at_first[1])
    # the same decode step fed held-out text, token by token (the tokens a reader would send)
    import torch

    from sparseinfer.data import HELDOUT_TEXT

    text = engine.encode(HELDOUT_TEXT.read_text()[:20000])[: n_tokens + 1]
    model, cache = engine.model, engine.model.new_cache(1, n_ctx)
    if info is not None:
        info.reset_stats()
    with torch.inference_mode():
        model(torch.tensor([text[:1]]), 0, cache, last_only=True)

        def feed():
            for i, tok in enumerate(text[1:]):
                model(torch.tensor([[tok]]), i + 1, cache, last_only=True).argmax(-1)

        # where the decode's time goes, phase by phase, timed in this run
        wall, split = timed_split(feed, len(text) - 1)
        forced = (len(text) - 1) / wall
    plan = engine.loaded.plan
    out = {"token_ms": split, "load_s": t_load, "peak_rss_mb": _peak_mb(),
           "prefill_tok_s": fin.prompt_tokens / fin.prefill_seconds,
           "decode_tok_s": (fin.completion_tokens - 1) / fin.decode_seconds,
           "text_tok_s": forced, "generated_density": gen_density, "plan": plan.summary()}
    dense_bytes = sum(w.nbytes for w in plan.weights
                      if w.module != "tok_emb" and w.storage != "sparse")
    out["bytes_per_token"] = dense_bytes
    if info is not None:
        dens = info.density()
        rows = sum(f.nbytes for m in info.modules for f, _ in m._rows() if f.d_ff)  # all parts
        preds = sum(t.nbytes for m in info.modules if m.predictor is not None
                    for t in (m.predictor.fc1, m.predictor.fc2, m.predictor.bias)
                    if t is not None)
        out |= {"density": dens, "rows_bytes": rows, "predictor_bytes": preds,
                "bytes_per_token": dense_bytes + preds + dens * rows,
                "layer_densities": [m.stats.active / max(1, m.stats.tokens * m.d_ff)
                                    for m in info.modules]}
    return out


def _llama_cpp(path: str, threads: int, n_tokens: int, n_ctx: int) -> dict:
    from llama_cpp import Llama

    from sparseinfer.bench import time_llama_cpp

    t0 = time.perf_counter()
    llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
    t_load = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode())
    llm.eval(ids[:4])  # warm-up
    t_prefill, t_dec = time_llama_cpp(llm, ids, n_tokens)
    from sparseinfer.data import HELDOUT_TEXT

    text = llm.tokenize(HELDOUT_TEXT.read_text()[:20000].encode(), add_bos=False)[: n_tokens + 1]
    llm.reset()
    llm.eval(text[:1])
    t0 = time.perf_counter()
    for tok in text[1:]:
        llm.eval([tok])
    forced = (len(text) - 1) / (time.perf_counter() - t0)
    import gguf

    r = gguf.GGUFReader(path)
    per_tok = sum(int(t.n_bytes) for t in r.tensors if t.name != "token_embd.weight")
    return {"load_s": t_load, "peak_rss_mb": _peak_mb(), "prefill_tok_s": len(ids) / t_prefill,
            "decode_tok_s": (n_tokens - 1) / t_dec, "text_tok_s": forced,
            "bytes_per_token": per_tok}


def convert(dense: Path, sparse: Path, work: Path, args) -> dict:
    """``sparseinfer convert`` in a child process: seconds and the child's peak RSS."""
    cmd = [sys.executable, "-m", "sparseinfer", "convert", "-m", str(dense), "-o", str(sparse),
           "--max-tokens", str(args.max_tokens), "--ranks", args.ranks, "--epochs",
           str(args.epochs), "-t", str(args.threads), "--outtype", "f16", "--work-dir", str(work),
           "--keep-work", "--eval-chunks", "0"]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB -> MiB
    return {"seconds": seconds, "peak_rss_mb": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for dense.gguf, sparse.gguf")
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--density", type=float, default=0.06,
                    help="designed mean firing rate (the predictors select ~1.5x more)")
    ap.add_argument("--gate-rank", type=int, default=16)
    ap.add_argument("--noise", type=float, default=0.1, help="full-rank share of the gate")
    ap.add_argument("--embed-rank", type=int, default=256,
                    help="token embeddings near a subspace of this rank (0: isotropic)")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers (a quick look)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens profiled by convert")
    ap.add_argument("--ranks", default="32,64", help="predictor ranks convert tries")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--skip-convert", action="store_true", help="reuse sparse.gguf")
    ap.add_argument("--sparse-rows", default="q4",
                    help=f"the sparse FFN's rows, one run each, comma-separated: "
                         f"{', '.join(SPARSE_ROWS)} (default q4; int8-q4-gates: int8 bundles "
                         f"beside the file's Q4_0 gate rows; q4i8: those gates, and bundles of "
                         f"the file's Q4_0 up rows and int8 down rows, the default of `run`)")
    ap.add_argument("--no-run", action="store_true",
                    help="stop after writing and converting (the files for beyond_ram.py)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from sparseinfer.bench import cpu_model, measure_read_bandwidth, run_isolated, split_line

    args.out.mkdir(parents=True, exist_ok=True)
    dense, sparse = args.out / "dense.gguf", args.out / "sparse.gguf"
    print(f"CPU: {cpu_model()}; {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if not dense.exists():
        t0 = time.perf_counter()
        made = write_model(dense, args.shape, args.density, args.gate_rank, args.noise,
                           args.embed_rank, args.layers)
        print(f"wrote {dense} ({dense.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s: designed density {made['designed_density']:.3f}, "
              f"top 20% of neurons carry {made['top20_share']:.0%} of activations, "
              f"{made['neurons_over_half']:.0f} neurons per layer fire on > half the tokens",
              flush=True)
    if not args.skip_convert or not sparse.exists():
        c = convert(dense, sparse, args.out / "work", args)
        print(f"convert: {c['seconds']:.0f} s, peak RSS {c['peak_rss_mb']:.0f} MiB "
              f"({c['peak_rss_mb'] * 2**20 / dense.stat().st_size:.2f}x the dense file)",
              flush=True)
    if args.no_run:
        return 0
    common = dict(threads=args.threads, n_tokens=args.tokens, n_ctx=args.ctx)
    kinds = args.sparse_rows.split(",")
    if not kinds or any(k not in SPARSE_ROWS for k in kinds):
        ap.error(f"--sparse-rows: expected some of {', '.join(SPARSE_ROWS)}, got "
                 f"{args.sparse_rows!r}")
    bw = measure_read_bandwidth(args.threads)
    rows = {}
    for k in kinds:
        rows[f"sparse {k}"] = run_isolated(_ours, path=str(sparse), rows=k, **common)
    rows["dense (ours)"] = run_isolated(_ours, path=str(dense), rows=None, **common)
    if not args.no_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python not installed: llama.cpp not measured", file=sys.stderr)
        else:
            rows["llama.cpp"] = run_isolated(_llama_cpp, path=str(dense), **common)
    bw = max(bw, measure_read_bandwidth(args.threads))
    print(f"read bandwidth ({args.threads} threads, best of before/after): {bw:.1f} GB/s; load "
          f"average {os.getloadavg()[0]:.1f}")
    print("\ndecode: tokens/s generating greedily after the prompt; text: the same step fed "
          "held-out text token by token (density, GB/token and bandwidth are the text run's)")
    print(f"\n{'engine':19s} {'load s':>7s} {'peak RSS':>9s} {'prefill':>8s} {'decode':>7s} "
          f"{'text':>7s} {'density':>8s} {'GB/token':>9s} {'GB/s':>6s} {'of BW':>6s} "
          f"{'floor':>6s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:19s} error: {r['error']}")
            continue
        gbs = r["bytes_per_token"] * r["text_tok_s"] / 1e9
        dens = f"{r['density']:.1%}" if "density" in r else "-"
        print(f"{name:19s} {r['load_s']:7.1f} {r['peak_rss_mb']:8.0f}M {r['prefill_tok_s']:8.2f} "
              f"{r['decode_tok_s']:7.2f} {r['text_tok_s']:7.2f} {dens:>8s} {r['bytes_per_token'] / 1e9:9.2f} {gbs:6.1f} "
              f"{gbs / bw:6.0%} {bw * 1e9 / r['bytes_per_token']:6.2f}")
    de, cpp = rows.get("dense (ours)", {}), rows.get("llama.cpp", {})
    for kind in kinds:
        name = f"sparse {kind}"
        sp = rows[name]
        if "decode_tok_s" not in sp:
            continue
        print(f"\n{name}:")
        for col in ("decode", "text"):
            ratios = [f"/ {k}: {sp[col + '_tok_s'] / r[col + '_tok_s']:.2f}x"
                      for k, r in [*((f"sparse {j}", rows[f"sparse {j}"]) for j in kinds
                                     if j != kind), ("dense (ours)", de), ("llama.cpp", cpp)]
                      if col + "_tok_s" in r]
            print(f"  {col}: " + ", ".join(ratios))
        print(f"  density generating: {sp['generated_density']:.1%}, on the text: "
              f"{sp['density']:.1%}")
        if sp["token_ms"]:
            print("  a token, ms (text run): " + split_line(sp["token_ms"]))
        print("  per-layer density: " + " ".join(f"{d:.2f}" for d in sp["layer_densities"]))
        print("  " + sp["plan"].replace("\n", "\n  "))
    if de.get("token_ms"):
        print("dense (ours): a token, ms (text run): " + split_line(de["token_ms"]))
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
