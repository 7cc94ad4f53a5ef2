"""Decode speed after long prompts, sparseinfer against llama.cpp, in one run: what the KV cache
adds to each token's bytes (llama.cpp holds keys and values in float16; ours as its load plan
says, ``--cache-type``: float16 by default for dense models on the C library).

    python benchmarks/long_context.py                          # SmolLM2, prompts of 64..3000
    python benchmarks/long_context.py -m gemma.gguf --prompts 64,1000 -t 1

Per prompt length (tokens of the held-out text, the model's own tokenizer): decode tokens/s of
``-n`` greedy tokens after the prompt (prefill not timed), ours and llama.cpp's, the ratio, and
the bytes a token reads: weights (the file's quantized bytes) plus the KV cache up to that
position (ours from the load plan, llama.cpp's 2 x layers x kv heads x head dim x 2). Each engine
runs in its own subprocess; the CPU model is printed beside the figures. llama.cpp needs
``llama-cpp-python`` (not installed by CI).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _ours(model, threads: int, lengths: list[int], n: int, n_ctx: int,
          kv_type: str = "auto") -> dict:
    from sparseinfer.threads import passive_wait

    passive_wait()  # as the CLI does, before torch starts its pool
    from sparseinfer.config import SamplingParams
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.engine import Engine, FinishEvent

    engine = Engine.load(model, n_ctx=n_ctx, threads=threads, kv_type=kv_type)
    toks = engine.tokenizer.encode(HELDOUT_TEXT.read_text(), add_bos=False)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    list(engine.stream(toks[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    out = {}
    for L in lengths:
        engine.forget_prefix()
        fin = [e for e in engine.stream(toks[:L], params) if isinstance(e, FinishEvent)][0]
        out[L] = (fin.completion_tokens - 1) / fin.decode_seconds
    return {"rates": out, "kv_bytes": engine.loaded.plan.kv_bytes_per_token}


def _llama_cpp(model, threads: int, lengths: list[int], n: int, n_ctx: int,
               kv_type: str = "auto") -> dict:
    from llama_cpp import Llama

    from sparseinfer.bench import time_llama_cpp
    from sparseinfer.data import HELDOUT_TEXT, default_model_path

    path = model or default_model_path()
    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
    toks = llm.tokenize(HELDOUT_TEXT.read_text().encode(), add_bos=False)
    llm.create_completion("Once upon a time", max_tokens=4, temperature=0.0)  # warm-up
    out = {}
    for L in lengths:
        _, t_dec = time_llama_cpp(llm, toks[:L], n)
        out[L] = (n - 1) / t_dec
    return {"rates": out, "kv_bytes": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF (default: embedded SmolLM2)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-n", "--tokens", type=int, default=64)
    p.add_argument("--prompts", default="64,1000,2000,3000", help="prompt lengths in tokens")
    p.add_argument("--cache-type", default="auto", choices=["auto", "fp32", "fp16"],
                   help="our KV cache's elements (default: what the load plan picks)")
    p.add_argument("--engine", choices=["ours", "llama.cpp"], help=argparse.SUPPRESS)
    a = p.parse_args()
    lengths = [int(x) for x in a.prompts.split(",")]
    n_ctx = max(lengths) + a.tokens + 16
    if a.engine:  # a subprocess: one engine, JSON out
        fn = _ours if a.engine == "ours" else _llama_cpp
        print(json.dumps(fn(a.model, a.threads, lengths, a.tokens, n_ctx, a.cache_type)))
        return
    from sparseinfer.bench import cpu_model
    from sparseinfer.data import default_model_path
    from sparseinfer.models.loading import open_source

    path = a.model or default_model_path()
    cfg = open_source(path).config
    kv_per_pos = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # elements per position
    weights = Path(path).stat().st_size
    res, kv_ours = {}, None
    for eng in ("ours", "llama.cpp"):
        cmd = [sys.executable, __file__, "--engine", eng, "-t", str(a.threads), "-n",
               str(a.tokens), "--prompts", a.prompts, "--cache-type", a.cache_type] + \
            (["-m", a.model] if a.model else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(f"# {eng} failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        res[eng] = {int(k): v for k, v in got["rates"].items()}
        if got["kv_bytes"] is not None:
            kv_ours = got["kv_bytes"]
        print(f"# {eng}: {time.perf_counter() - t0:.0f} s")
    print(f"# {cpu_model()}; {a.threads} thread(s); {path}; decode of {a.tokens} tokens after "
          f"the prompt; weights {weights / 1e6:.0f} MB")
    print(f"{'prompt':>7} {'ours tok/s':>11} {'llama.cpp':>10} {'ratio':>6} "
          f"{'KV MB/token ours':>17} {'llama.cpp':>10}")
    for L in lengths:
        o, c = res.get("ours", {}).get(L), res.get("llama.cpp", {}).get(L)
        ratio = f"{o / c:5.2f}x" if o and c else "    -"
        pos = L + a.tokens // 2  # the mean position of the decoded tokens
        mine = f"{kv_ours * pos / 1e6:17.1f}" if kv_ours else f"{'-':>17}"
        print(f"{L:>7} {o or float('nan'):>11.1f} {c or float('nan'):>10.1f} {ratio:>6} "
              f"{mine} {kv_per_pos * pos * 2 / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
