"""Predictors on a *trained* ReLU-family model: train a small ReGLU llama on Austen here, then run
the offline pipeline on it and report the predictor targets (recall >= 0.99 at predicted density
<= 1.5x true).

    python benchmarks/relu_predictors.py [--steps 800] [--out out/tiny-reglu]
        [--d-model 256 --d-ff 1024]

No trained ReLU-family LLM (ReluLLaMA, ProSparse, TurboSparse) can be downloaded here, and random
weights have no learned activation structure to predict. A model trained for a few minutes on
the default corpus does: its ReLU gates learn which neurons matter for which inputs. Steps:

1. a byte-level BPE tokenizer (vocab 2048) and a LlamaForCausalLM with ``hidden_act="relu"``
   (ReGLU: d_model 256, d_ff 1024 by default, 4 layers, 4 heads) trained with AdamW on the Emma excerpt
   (``sparseinfer.data.DEFAULT_CORPUS``), saved as safetensors;
2. ``sparseinfer convert`` on it (profile = exact ReLU zeros, predictors, export), whose summary
   table gives per layer the true density, the predictor rank, recall, precision and predicted
   density on held-out tokens;
3. perplexity on held-out *Sense and Sensibility* of the dense model and of the sparse file
   (predictor mode) with the CLI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparseinfer.data import DEFAULT_CORPUS, HELDOUT_TEXT

VOCAB = 2048


def train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([DEFAULT_CORPUS.read_text(encoding="utf-8")], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False}))


def train_model(out: Path, steps: int, d_model: int, d_ff: int, seq: int = 128,
                batch: int = 8) -> None:
    import transformers as tf
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(
        DEFAULT_CORPUS.read_text(encoding="utf-8")).ids
    data = torch.tensor(ids)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=d_model, intermediate_size=d_ff,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=512, hidden_act="relu", rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # warm-up 5% of the steps, at least 2 (OneCycleLR divides by zero when its first phase is
    # under two steps: --steps 20 failed)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps,
                                                pct_start=min(0.5, max(0.05, 2 / steps)))
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - t0:6.0f} s",
                  flush=True)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--out", type=Path, default=Path("out/tiny-reglu"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    a = ap.parse_args()
    if a.steps < 4:
        ap.error(f"--steps: expected at least 4 training steps, got {a.steps}")
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    if not (a.out / "model.safetensors").exists():
        train_tokenizer(a.out)
        train_model(a.out, a.steps, a.d_model, a.d_ff)
    sparse = a.out.with_suffix(".sparse.gguf")
    cli = [sys.executable, "-m", "sparseinfer"]
    subprocess.run([*cli, "convert", "-m", str(a.out), "-o", str(sparse), "-t", str(a.threads),
                    "--max-tokens", "65536", "--chunk-len", "256"], check=True)
    for label, argv in (("dense model", ["-m", str(a.out)]),
                        ("sparse file", ["-m", str(sparse)])):
        r = subprocess.run([*cli, "perplexity", *argv, "-f", str(HELDOUT_TEXT), "-c", "256",
                            "-t", str(a.threads)], capture_output=True, text=True, check=True)
        extra = [ln for ln in r.stderr.splitlines() if "neurons computed" in ln]
        print(f"{label}: {r.stdout.strip().splitlines()[-1]}  {' '.join(extra)}")


if __name__ == "__main__":
    main()
