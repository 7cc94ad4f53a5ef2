"""Our logits against transformers' on tiny random models of every architecture / FFN kind, and on
SmolLM2 loaded from its GGUF by both."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_KINDS, gguf_parsed_once, tiny_hf_model
from sparseinfer.models.loading import load_model


def _ours(lm, ids: torch.Tensor) -> torch.Tensor:
    cache = lm.model.new_cache(ids.shape[0], ids.shape[1] + 1)
    with torch.inference_mode():
        return lm.model(ids, 0, cache)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_logits_match_transformers(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    ref = tiny_hf_model(kind)  # same seed -> same weights as the saved one
    lm = load_model(path)
    expected = {"opt": "relu"}.get(kind, kind)
    assert lm.config.ffn_kind == expected
    ids = torch.randint(3, lm.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    got = _ours(lm, ids)
    assert got.shape == want.shape
    assert _rel_err(got, want) < 1e-4


@pytest.mark.parametrize("kind", ["swiglu", "opt"])
def test_incremental_decode_equals_full_forward(tiny_model_dir, kind):
    lm = load_model(tiny_model_dir(kind))
    ids = torch.randint(3, lm.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    full = _ours(lm, ids)[0]
    cache = lm.model.new_cache(1, 32)
    with torch.inference_mode():
        steps = [lm.model(ids[:, :16], 0, cache)[0]]
        for t in range(16, 24):
            steps.append(lm.model(ids[:, t:t + 1], t, cache)[0])
    assert _rel_err(torch.cat(steps), full) < 1e-5


def test_bf16_weights_close_to_fp32(tiny_model_dir):
    path = tiny_model_dir("swiglu")
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(3))
    fp32, bf16 = load_model(path), load_model(path, dtype="bf16")
    assert bf16.model.layers[0].ffn.w_in.weight.dtype == torch.bfloat16
    assert _rel_err(_ours(bf16, ids), _ours(fp32, ids)) < 0.05


@pytest.mark.slow
def test_weights_held_once(smollm2):
    """Tied embeddings share one tensor, and no parameter is left on the meta device."""
    m = smollm2.model
    assert m.lm_head.weight is m.tok_emb.weight
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    from sparseinfer.data import HELDOUT_TEXT

    import transformers as tf

    p = smollm2.path
    with gguf_parsed_once():
        tok = tf.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    ids = torch.tensor([tok(HELDOUT_TEXT.read_text()[:1500])["input_ids"][:300]])
    assert ids.shape[1] == 300
    with torch.no_grad():
        want = smollm2_hf(ids).logits
    got = _ours(smollm2, ids)
    assert _rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _assert_greedy_matches(engine, hf, text: str, n: int = 24) -> None:
    """Our greedy continuation of ``text`` equals transformers' generate, token for token."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import TokenEvent

    prompt = engine.encode(text)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ours = [e.token_id for e in engine.stream(prompt, params) if isinstance(e, TokenEvent)]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n)
    assert ours == out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm2, smollm2_hf):
    from sparseinfer.engine import Engine

    engine = Engine(smollm2, n_ctx=256)  # plain torch ops
    _assert_greedy_matches(engine, smollm2_hf,
                           "The capital of France is Paris. The capital of Germany is")


@pytest.mark.slow
def test_smollm2_greedy_through_engine_load_with_kernels(smollm2_hf):
    """The fp32 CLI path (Engine.load: numba kernels for decode) gives transformers' greedy
    text. (The default for this Q4_1 file is --dtype q4, judged by perplexity in tests/quant.)"""
    from sparseinfer.engine import Engine

    engine = Engine.load(None, n_ctx=256, threads=2, dtype="fp32")
    assert type(engine.model.lm_head).__name__ == "FloatLinear"
    assert engine.model.layers[0].fused is not None
    _assert_greedy_matches(engine, smollm2_hf, "Pride and Prejudice was written by")
