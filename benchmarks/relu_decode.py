"""End-to-end decode on a ReLU-family model shaped like TinyLlama-1.1B: sparse runtime vs our
dense engine, in one run.

    python benchmarks/relu_decode.py [-t 2] [--density 0.1] [-n 64]

No trained ReLU-family weights exist here (ReluLLaMA, ProSparse, TurboSparse are not on this
machine), so the model has random weights (ReGLU FFN, 22 layers, d_model 2048, d_ff 5632, GQA
32/4, vocab 49152 (SmolLM2's tokenizer), fp32: 4.6 GB, written once as a GGUF) and random low-rank predictors whose per-neuron biases are set so
that each neuron fires on a skewed share of tokens averaging ``--density`` (hot neurons on most
tokens, most neurons rarely, as PowerInfer measured on real ReLU models). This measures speed
only: the output text is meaningless and no perplexity is claimed. The measured density (share
of neurons the predictors selected per token) is printed beside the speed.

Four engines, each with everything the CLI uses for it: fp32 (numba GEMVs for attention and the
LM head, fused single-token norm/rope/attention kernels; dense runs the all-neuron FFN kernel,
sparse the predictor + sparse FFN kernels), and the same with 4-bit attention, int8 head
(``--dtype q4``): dense q4 (4-bit FFN) vs sparse with int8 FFN rows.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from sparseinfer.bench import measure_read_bandwidth
from sparseinfer.config import ModelConfig
from sparseinfer.engine import set_threads
from sparseinfer.models.build import load
from sparseinfer.sparse.runtime import sparse_info

CFG = ModelConfig(arch="llama", vocab_size=49152, d_model=2048, n_layers=22, n_heads=32,
                  n_kv_heads=4, d_ff=5632, max_seq_len=2048, ffn_kind="reglu",
                  name="random ReGLU, TinyLlama-1.1B shape")
RANK = 128


def write(path: Path, density: float, seed: int = 0) -> Path:
    """The random ReGLU model and its predictors as one F32 GGUF (loaded like any sparse file)."""
    import gguf

    from sparseinfer.data import default_model_path
    from sparseinfer.offline.export import _copy_fields

    g = torch.Generator().manual_seed(seed)
    c = CFG
    D, F, hd = c.d_model, c.d_ff, c.d_model // c.n_heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).numpy()

    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_context_length(c.max_seq_len)
    wr.add_embedding_length(D)
    wr.add_block_count(c.n_layers)
    wr.add_feed_forward_length(F)
    wr.add_rope_dimension_count(hd)
    wr.add_head_count(c.n_heads)
    wr.add_head_count_kv(c.n_kv_heads)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_string("sparseinfer.ffn_kind", "reglu")
    _copy_fields(wr, gguf.GGUFReader(default_model_path()), lambda k: k.startswith("tokenizer."))
    ones = np.ones(D, dtype=np.float32)
    wr.add_tensor("token_embd.weight", w(c.vocab_size, D))
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", w(c.vocab_size, D))
    for name, arr in predictors(density).items():
        wr.add_tensor(name, arr)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        for name, arr in (("attn_norm", ones), ("ffn_norm", ones),
                          ("attn_q", w(c.n_heads * hd, D)), ("attn_k", w(c.n_kv_heads * hd, D)),
                          ("attn_v", w(c.n_kv_heads * hd, D)), ("attn_output", w(D, c.n_heads * hd)),
                          ("ffn_gate", w(F, D)), ("ffn_up", w(F, D)), ("ffn_down", w(D, F))):
            wr.add_tensor(p + name + ".weight", arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def predictors(density: float, seed: int = 1) -> dict[str, np.ndarray]:
    """Random predictors with per-neuron biases giving skewed firing rates around ``density``."""
    rng = np.random.default_rng(seed)
    c = CFG
    freq = (np.arange(c.d_ff) + 1.0) ** -0.6
    freq = np.clip(freq * density * c.d_ff / freq.sum(), 1e-4, 1.0)
    x = rng.standard_normal((512, c.d_model)).astype(np.float32)
    extras = {}
    for i in range(c.n_layers):
        fc1 = (rng.standard_normal((RANK, c.d_model)) / math.sqrt(c.d_model)).astype(np.float32)
        fc2 = (rng.standard_normal((c.d_ff, RANK)) / math.sqrt(RANK)).astype(np.float32)
        z = np.maximum(x @ fc1.T, 0) @ fc2.T  # (512, d_ff) logits on unit-scale inputs
        k = np.minimum(((1 - freq) * len(x)).astype(int), len(x) - 1)
        bias = -np.sort(z, axis=0)[k, np.arange(c.d_ff)].astype(np.float32)
        extras |= {f"blk.{i}.fc1.weight": fc1, f"blk.{i}.fc2.weight": fc2,
                   f"blk.{i}.fc2.bias": bias}
    return extras


def decode(model, n: int) -> float:
    cache = model.new_cache(1, 256)
    prompt = torch.arange(1, 17).view(1, -1)
    with torch.inference_mode():
        logits = model(prompt, 0, cache, last_only=True)
        tok = logits.argmax(-1)
        for i in range(4):  # warm-up
            tok = model(tok, 16 + i, cache, last_only=True).argmax(-1)
        t0 = time.perf_counter()
        for i in range(n):
            tok = model(tok, 20 + i, cache, last_only=True).argmax(-1)
        return n / (time.perf_counter() - t0)


def main() -> None:
    global CFG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.10)
    ap.add_argument("--layers", type=int, default=CFG.n_layers, help="fewer for a smoke run")
    ap.add_argument("--out", type=Path, default=Path("/tmp"), help="where the GGUF is written")
    a = ap.parse_args()
    CFG = replace(CFG, n_layers=a.layers)
    set_threads(a.threads)
    path = a.out / f"relu-tinyllama-{a.layers}l-d{a.density:g}.gguf"
    if not path.exists():
        write(path, a.density)
    bw = measure_read_bandwidth(a.threads)
    print(f"# {CFG.name}; {a.threads} threads; read bandwidth {bw:.1f} GB/s at the start; each "
          f"row's floor uses the highest reading so far (start and after each engine)")
    c = CFG
    attn_head = (c.n_layers * (2 * c.d_model * c.d_model + 2 * c.d_model * c.d_model // 8)
                 + c.vocab_size * c.d_model) * 4
    ffn = c.n_layers * 3 * c.d_model * c.d_ff * 4
    q4 = 0.5 + 4 / 32  # bytes per weight of 4-bit blocks with bf16 scale and zero per 32
    rows = []
    for label in ("dense fp32", "sparse fp32", "dense q4", "sparse int8 + q4"):
        lm = load(path, "q4" if "q4" in label else "fp32", dense=label.startswith("dense"),
                  ffn_dtype="int8" if "int8" in label else "fp32", fused=True)
        model = lm.model
        info = sparse_info(model, lm.plan)
        if info is not None:
            info.reset_stats()
        tok_s = decode(model, a.tokens)
        dens = info.density() if info is not None else 1.0
        head = c.vocab_size * c.d_model * 4
        attn = attn_head - head
        if "q4" in label:  # 4-bit attention (and FFN when dense), int8 head
            attn, head = attn * q4 / 4, head / 4
        ffn_bytes = ffn * (q4 / 4 if label == "dense q4" else 0.25 if "int8" in label else 1.0)
        nbytes = attn + head + ffn_bytes * dens
        if info is not None:  # predictors: fp32, bf16 beside int8 rows
            nbytes += c.n_layers * RANK * (c.d_model + c.d_ff) * (2 if "int8" in label else 4)
        rows.append((label, tok_s, dens, nbytes))
        bw = max(bw, measure_read_bandwidth(a.threads))  # the VM's bandwidth drifts: the higher
        print(f"{label:17s} {tok_s:6.2f} tok/s  density {dens:6.1%}  "
              f"{nbytes / 1e9:5.2f} GB/token  floor {bw * 1e9 / nbytes:6.2f} tok/s  "
              f"({tok_s * nbytes / 1e9 / bw:.0%} of bandwidth)", flush=True)
        del model, lm, info
    print(f"sparse / dense, fp32: {rows[1][1] / rows[0][1]:.2f}x; sparse int8 + q4 / dense q4: "
          f"{rows[3][1] / rows[2][1]:.2f}x")


if __name__ == "__main__":
    main()
