"""Decode speed of sparseinfer (dense and sparse) against transformers and llama.cpp, in one run.

    python benchmarks/decode.py                       # dense SmolLM2 vs transformers
    python benchmarks/decode.py --sparse out/smollm2.sparse.gguf --ppl-chunks 4

Each engine runs in its own subprocess (clean peak RSS, no shared caches), one after the other,
on the same prompt with greedy decoding and EOS ignored. Printed per engine: prefill and decode
tokens/s, bytes of weights read per decoded token, the achieved GB/s against the machine's
measured read bandwidth (the physical floor), peak RSS, the ratio to transformers and to
llama.cpp (when `llama-cpp-python` is installed), and optionally held-out perplexity.
Machines are noisy: compare the ratios of one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife. However little known the feelings or views of "
          "such a man may be on his first entering a neighbourhood, this truth is so well fixed "
          "in the minds of the surrounding families, that he is considered")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ours(model, dense: bool, threads: int, n_tokens: int, ppl_chunks: int,
          ffn_dtype: str, kernels: bool = True, dtype: str = "fp32") -> dict:
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch and numba start their pools
    import torch

    from sparseinfer.config import SamplingParams
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.engine import Engine, FinishEvent
    from sparseinfer.perplexity import perplexity

    engine = Engine.load(model, n_ctx=1024, threads=threads, dense=dense, ffn_dtype=ffn_dtype,
                         kernels=kernels, dtype=dtype)
    m = engine.model
    ids = engine.encode(PROMPT)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    list(engine.stream(ids[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    engine._cached_ids = []  # no prefix reuse: time the whole prompt
    info = engine.sparse_info
    if info is not None:
        info.reset_stats()
    fin = [e for e in engine.stream(ids, params) if isinstance(e, FinishEvent)][0]
    density = info.density() if info is not None else 1.0

    # bytes of weights one decoded token reads: every planned weight once (the embedding row
    # is negligible; a tied head reads the embedding's blocks), sparse FFN rows scaled by the
    # density, predictors counted in full
    plan = engine.loaded.plan
    nbytes = 0
    for w in plan.weights:
        if w.module == "tok_emb":
            continue
        if w.storage == "sparse":
            ffn = dict(m.named_modules())[w.module]
            rows = sum(t.nbytes for t in (ffn.cold, ffn.hot) if t is not None)
            pred = ffn.predictor
            pbytes = 0 if pred is None else sum(t.numel() * t.element_size()
                                                for t in (pred.fc1, pred.fc2))
            nbytes += int(rows * density) + pbytes
        else:
            nbytes += w.nbytes
    if plan.weight("lm_head").nbytes == 0:  # tied head: the embedding's mapped blocks
        nbytes += plan.weight("tok_emb").nbytes
    out = {
        "prefill_tok_s": fin.prompt_tokens / fin.prefill_seconds,
        "decode_tok_s": (fin.completion_tokens - 1) / fin.decode_seconds,
        "bytes_per_token": nbytes,
        "density": density,
        "prompt_tokens": fin.prompt_tokens,
    }
    if ppl_chunks:
        if info is not None:
            info.set_batch_mode("masked")
            info.reset_stats()
        toks = engine.tokenizer.encode(HELDOUT_TEXT.read_text(), add_bos=False)
        out["ppl"] = perplexity(m, toks, 512, None, ppl_chunks).ppl
        if info is not None:
            out["ppl_density"] = info.density()
    out["peak_rss_mb"] = _peak_rss_mb()
    del torch
    return out


def _transformers(model, threads: int, n_tokens: int, ppl_chunks: int) -> dict:
    import torch
    import transformers as tf

    from sparseinfer.data import default_model_path

    torch.set_num_threads(threads)
    path = model or default_model_path()
    tok = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    kw = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        hf.generate(ids[:, :8], max_new_tokens=8, min_new_tokens=8, **kw)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, **kw)
        t_total = time.perf_counter() - t0
    n_params = sum(p.numel() for p in hf.parameters())
    return {
        "prefill_tok_s": ids.shape[1] / t_prefill,
        "decode_tok_s": (n_tokens - 1) / max(t_total - t_prefill, 1e-9),
        "bytes_per_token": 4 * n_params,
        "density": 1.0,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _llama_cpp(model, threads: int, n_tokens: int, ppl_chunks: int) -> dict:
    from llama_cpp import Llama

    from sparseinfer.bench import time_llama_cpp

    from sparseinfer.data import default_model_path

    path = model or default_model_path()
    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False,
                logits_all=bool(ppl_chunks))
    ids = llm.tokenize(PROMPT.encode())
    llm.create_completion(PROMPT[:40], max_tokens=8, temperature=0.0)  # warm-up
    t_prefill, t_dec = time_llama_cpp(llm, ids, n_tokens)
    out = {
        "prefill_tok_s": len(ids) / t_prefill,
        "decode_tok_s": (n_tokens - 1) / t_dec,
        "bytes_per_token": path.stat().st_size,  # quantized weights, read once per token
        "density": 1.0,
    }
    if ppl_chunks:  # the same token ids and scoring as sparseinfer.perplexity (second halves)
        import numpy as np

        from sparseinfer.data import HELDOUT_TEXT
        from sparseinfer.models.loading import open_gguf
        from sparseinfer.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(open_gguf(path), path)
        toks = tok.encode(HELDOUT_TEXT.read_text(), add_bos=False)
        nll, n = 0.0, 0
        for c in range(ppl_chunks):
            chunk = toks[c * 512:(c + 1) * 512]
            llm.reset()
            llm.eval(chunk)
            logits = np.asarray(llm.scores[:512], dtype=np.float64)[256:-1]
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            nll -= float(logp[np.arange(255), chunk[257:]].sum())
            n += 255
        out["ppl"] = float(np.exp(nll / n))
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="dense model (default: embedded SmolLM2)")
    ap.add_argument("--sparse", default=None, help="sparse GGUF from `sparseinfer convert`")
    ap.add_argument("--ffn-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "q4"],
                    help="sparse FFN rows of the sparse engine (default: what `run` uses)")
    ap.add_argument("--sparse-dtype", default="auto", choices=["auto", "fp32", "q4"],
                    help="attention / LM head weights of the sparse engine")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--ppl-chunks", type=int, default=0, help="held-out perplexity chunks (512)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = ap.parse_args()

    from pathlib import Path

    from sparseinfer.bench import cpu_model, measure_read_bandwidth, run_isolated

    model = Path(args.model) if args.model else None
    bw = measure_read_bandwidth(args.threads)
    print(f"CPU: {cpu_model()}; read bandwidth ({args.threads} threads): {bw:.1f} GB/s")
    rows = {}
    common = dict(threads=args.threads, n_tokens=args.tokens, ppl_chunks=args.ppl_chunks)
    rows["sparseinfer default (auto)"] = run_isolated(_ours, model=model, dense=True,
                                                      ffn_dtype="fp32", dtype="auto", **common)
    rows["sparseinfer fp32, unfused"] = run_isolated(_ours, model=model, dense=True,
                                                     ffn_dtype="fp32", kernels=False, **common)
    rows["sparseinfer dense fp32"] = run_isolated(_ours, model=model, dense=True,
                                                  ffn_dtype="fp32", **common)
    rows["sparseinfer dense q4"] = run_isolated(_ours, model=model, dense=True,
                                                ffn_dtype="fp32", dtype="q4", **common)
    if args.sparse:
        rows[f"sparseinfer sparse {args.ffn_dtype}/{args.sparse_dtype}"] = run_isolated(
            _ours, model=Path(args.sparse), dense=False, ffn_dtype=args.ffn_dtype,
            dtype=args.sparse_dtype, **common)
    if not args.no_transformers:
        rows["transformers fp32"] = run_isolated(_transformers, model=model, **common)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: llama.cpp not measured", file=sys.stderr)
    else:
        rows["llama.cpp (GGUF as is)"] = run_isolated(_llama_cpp, model=model, **common)

    ref_hf = rows.get("transformers fp32", {}).get("decode_tok_s")
    ref_cpp = rows.get("llama.cpp (GGUF as is)", {}).get("decode_tok_s")
    print(f"\n{'engine':28s} {'prefill':>9s} {'decode':>8s} {'MB/tok':>7s} {'GB/s':>6s} "
          f"{'of BW':>6s} {'floor':>7s} {'density':>7s} {'RSS MB':>7s} {'vs HF':>6s} "
          f"{'vs cpp':>6s} {'PPL':>8s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:28s} error: {r['error']}")
            continue
        gbs = r["bytes_per_token"] * r["decode_tok_s"] / 1e9
        floor = bw * 1e9 / r["bytes_per_token"]
        ratio = lambda ref: f"{r['decode_tok_s'] / ref:5.2f}x" if ref else "     -"  # noqa: E731
        ppl = f"{r['ppl']:8.3f}" if "ppl" in r else "       -"
        print(f"{name:28s} {r['prefill_tok_s']:7.1f}/s {r['decode_tok_s']:6.1f}/s "
              f"{r['bytes_per_token'] / 1e6:7.1f} {gbs:6.1f} {gbs / bw:6.0%} {floor:5.1f}/s "
              f"{r['density']:7.1%} {r['peak_rss_mb']:7.0f} {ratio(ref_hf)} {ratio(ref_cpp)} {ppl}")
    print("\nfloor = decode tokens/s if every weight byte a token needs were read once at the "
          "measured bandwidth", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
