"""``generate.embedding`` / ``Engine.embed`` (``/v1/embeddings``): a text's final-normed hidden
states pooled into one unit vector, against transformers' ``last_hidden_state`` of the same
GGUF (SmolLM2) and of the tiny models of every FFN kind."""

from __future__ import annotations

import pytest
import torch

from sparseinfer.errors import ContextOverflowError, SparseInferError
from sparseinfer.generate import POOLINGS, embedding
from sparseinfer.models.loading import load_model

from .conftest import TINY_KINDS, tiny_hf_model

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def _reference(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h.mean(0) if pooling == "mean" else h[-1]
    return v / v.norm()


@pytest.mark.slow
@pytest.mark.parametrize("pooling", sorted(POOLINGS))
def test_smollm2_embedding_matches_transformers(smollm2, smollm2_hf, pooling):
    ids = smollm2.tokenizer.encode(TEXT)
    got = embedding(smollm2.model, ids, smollm2.model.new_cache(1, len(ids)), pooling)
    want = _reference(smollm2_hf, ids, pooling)
    assert got.shape == (smollm2.config.d_model,) and abs(float(got.norm()) - 1) < 1e-5
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_models_embedding_matches_transformers(tiny_model_dir, kind, monkeypatch):
    """Over several prefill chunks (made small here): the chunks' hidden states are pooled
    together."""
    import sparseinfer.generate

    monkeypatch.setattr(sparseinfer.generate, "PREFILL_CHUNK", 64)
    lm = load_model(tiny_model_dir(kind))
    hf = tiny_hf_model(kind)
    ids = torch.randint(3, lm.config.vocab_size, (200,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    for pooling in POOLINGS:
        got = embedding(lm.model, ids, lm.model.new_cache(1, len(ids)), pooling)
        torch.testing.assert_close(got, _reference(hf, ids, pooling), atol=2e-5, rtol=1e-4)


def test_engine_embed_fills_the_context_and_no_more(tiny_model_dir):
    from sparseinfer.engine import Engine

    engine = Engine(load_model(tiny_model_dir("swiglu")), n_ctx=32)
    ids = list(range(3, 35))
    v = engine.embed(ids)  # all 32 positions: an embedding generates nothing after its text
    assert len(v) == engine.model.cfg.d_model
    with pytest.raises(ContextOverflowError, match="the input has 33 tokens but the context "
                                                   "holds 32"):
        engine.embed(ids + [3])
    with pytest.raises(SparseInferError, match="the input is empty"):
        engine.embed([])
    # the cache it overwrote is not taken for a later prompt's prefix
    assert engine._cached_ids == [] and engine.embed(ids, "last") != v
