"""Context shift (llama.cpp's ``--context-shift``): past a full cache, generation keeps the first
n_keep tokens, drops half of the rest and goes on.

- ``recompute``: the logits after each shift equal a fresh run over the shifted token sequence,
  on every kind of model (rope rotate-half / adjacent pairs / per-layer bases / factors, learned
  positions).
- ``rotate`` (llama.cpp's K-shift): the kept keys are rotated to their new positions. Above the
  first layer the kept entries still carry what they saw of the dropped tokens (as in
  llama.cpp), so a fresh run is the reference only for one-layer models, where each key and
  value depends on its own token and position alone: there the logits must equal a fresh run's
  (rotate-half, adjacent pairs, a windowed layer's own rope base, llama3 factors); on real
  SmolLM2 the first layer's keys and values must equal a fresh run's."""

from __future__ import annotations

import pytest
import torch

from sparseinfer.config import ModelConfig, SamplingParams
from sparseinfer.engine import Engine, FinishEvent
from sparseinfer.generate import ContextShift, generate
from sparseinfer.models.loading import load_model
from sparseinfer.models.model import Transformer

GREEDY = SamplingParams(max_tokens=-1, temperature=0.0, ignore_eos=True)


def _fresh_logits(model, seq: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(seq))
    with torch.inference_mode():
        return model(torch.tensor([seq]), 0, cache, last_only=True)[0, -1]


def _expected_shifts(n_prompt: int, n_keep: int, n_ctx: int, n_new: int) -> list[tuple[int, int]]:
    """llama.cpp's rule, independently: whenever n_past reaches n_ctx, drop (n_past - n_keep) / 2
    tokens after the first n_keep."""
    shifts, n_past = [], n_prompt
    for _ in range(n_new - 1):  # every generated token but the last one is run
        if n_past == n_ctx:
            d = (n_past - n_keep) // 2
            shifts.append((n_keep, d))
            n_past -= d
        n_past += 1
    return shifts


def _check_shift(model, prompt: list[int], n_ctx: int, keep: int, n_new: int,
                 bos_id=None, recompute: bool = True, stride: int = 3) -> None:
    cache = model.new_cache(1, n_ctx)
    seen: list[torch.Tensor] = []
    shifts: list[tuple[int, int]] = []
    gen = generate(model, prompt, GREEDY, cache, observe=lambda lg, t: seen.append(lg.clone()),
                   context_shift=ContextShift(keep, recompute), bos_id=bos_id,
                   on_shift=lambda k, d: shifts.append((k, d)))
    with torch.inference_mode():
        out = [next(gen) for _ in range(n_new)]
    n_keep = ContextShift(keep).n_keep(prompt, bos_id)
    assert shifts == _expected_shifts(len(prompt), n_keep, n_ctx, n_new)
    assert len(shifts) >= 2
    # replay the shifts on the token list: token i's logits must equal a fresh run over what
    # the cache held (the kept tokens, renumbered from 0) followed by token i - 1
    held, pending, worst = list(prompt), list(shifts), 0.0
    for i in range(1, n_new):
        shifted = len(held) == n_ctx
        if shifted:
            k, d = pending.pop(0)
            del held[k:k + d]
        held.append(out[i - 1])
        if not (shifted or i % stride == 0):
            continue  # the first token after each shift, and every stride-th
        want = _fresh_logits(model, held)
        worst = max(worst, float((seen[i] - want).abs().max() / want.abs().max()))
    assert not pending
    assert worst < 1e-4, worst


@pytest.mark.parametrize("kind", ["swiglu", "opt"])  # rope (rotate-half), learned positions
def test_shift_matches_fresh_run_tiny(tiny_model_dir, kind):
    lm = load_model(tiny_model_dir(kind))
    prompt = [5, 9, 11, 40, 41, 42, 43, 44, 45, 46]
    _check_shift(lm.model, prompt, n_ctx=24, keep=3, n_new=50)


# per-layer rope bases and windows; factors; a layer without rope
@pytest.mark.parametrize("name", ["gemma3", "llama3", "smollm3"])
def test_shift_matches_fresh_run_arch(arch_model_dir, name):
    lm = load_model(arch_model_dir(name))
    prompt = list(range(3, 13))
    _check_shift(lm.model, prompt, n_ctx=24, keep=2, n_new=50)


@pytest.mark.slow
def test_shift_matches_fresh_run_smollm2_interleaved(smollm2):
    """SmolLM2's GGUF: rope over adjacent pairs (rows as llama.cpp stores them), BOS kept."""
    assert smollm2.config.rope_interleaved
    tok = smollm2.tokenizer
    prompt = tok.encode("Emma Woodhouse, handsome, clever, and rich")
    assert prompt[0] == tok.bos_id or not tok.add_bos
    _check_shift(smollm2.model, prompt, n_ctx=24, keep=2, n_new=40, bos_id=tok.bos_id,
                 stride=8)


def _one_layer(**fields) -> Transformer:
    cfg = ModelConfig(arch="llama", vocab_size=97, d_model=64, n_layers=1, n_heads=4,
                      n_kv_heads=2, d_ff=96, max_seq_len=64, **fields)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(torch.randn(t.shape, generator=g) * (0.05 if "norm" in name else 0.3)
                    + (1.0 if "norm" in name else 0.0))
    return model


@pytest.mark.parametrize("fields", [
    {}, {"rope_interleaved": True},
    {"attn_windows": (16,), "rope_theta_local": 500.0, "rope_theta": 1e6},
    {"rope_factors": tuple(1.0 + i for i in range(8))},
    {"nope_layers": (0,)},
], ids=["rotate-half", "adjacent-pairs", "local-base", "factors", "nope"])
def test_rotation_matches_fresh_run_one_layer(fields):
    model = _one_layer(**fields)
    model.new_cache(1, 64)  # rope tables
    _check_shift(model, [3, 1, 4, 1, 5, 9, 2, 6], n_ctx=20, keep=3, n_new=45, recompute=False)


@pytest.mark.slow
def test_rotation_first_layer_kv_smollm2(smollm2):
    """Real SmolLM2 (adjacent-pair rope): after a rotation the first layer's cached keys and
    values are those a fresh run over the kept tokens computes."""
    model = smollm2.model
    seq = smollm2.tokenizer.encode("It was the best of times, it was the worst of times, it was")
    n = len(seq)
    keep, discard = 3, (n - 3) // 2
    cache = model.new_cache(1, n)
    with torch.inference_mode():
        model(torch.tensor([seq]), 0, cache, last_only=True)
        model.shift_cache(cache, keep, discard, n)
        kept = seq[:keep] + seq[keep + discard:]
        ref = model.new_cache(1, n)
        model(torch.tensor([kept]), 0, ref, last_only=True)
    m = len(kept)
    for a, b in ((cache.k, ref.k), (cache.v, ref.v)):
        err = (a[0, :, :, :m] - b[0, :, :, :m]).abs().max() / b[0, :, :, :m].abs().max()
        assert float(err) < 1e-5


def test_n_keep_follows_llama_cpp():
    assert ContextShift(0).n_keep([1, 7, 8], bos_id=1) == 1  # BOS is always kept
    assert ContextShift(2).n_keep([1, 7, 8, 9], bos_id=1) == 3
    assert ContextShift(2).n_keep([7, 8, 9], bos_id=1) == 2
    assert ContextShift(-1).n_keep([1, 7, 8], bos_id=1) == 3  # -1: the whole prompt
    assert ContextShift(99).n_keep([7, 8], bos_id=None) == 2


def _stream(engine, prompt, params, shift):
    events = list(engine.stream(prompt, params, context_shift=shift))
    assert isinstance(events[-1], FinishEvent)
    return [e.token_id for e in events[:-1] if e.token_id >= 0], events[-1]


def test_engine_generates_past_the_context_with_shift(tiny_model_dir):
    """Through the engine with the fused decode kernels: -n beyond the context goes on with the
    flag and stops at the context without it; a later call reuses the shifted cache correctly."""
    engine = Engine.load(tiny_model_dir("swiglu"), n_ctx=32)
    prompt = engine.encode("Emma Woodhouse, handsome, clever")
    p = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    ids, fin = _stream(engine, prompt, p, None)
    assert fin.reason == "length" and len(prompt) + len(ids) == 32
    shifted, fin = _stream(engine, prompt, p, ContextShift(4))  # rotating keys
    assert len(shifted) == 80 and fin.completion_tokens == 80
    assert shifted[:len(ids)] == ids  # identical until the first shift
    # the engine's record of the cache follows the shifts: the same call again (prefix reuse
    # from a shifted cache) gives the same tokens as a fresh engine
    again, _ = _stream(engine, prompt, p, ContextShift(4))
    fresh = Engine(engine.loaded, n_ctx=32)
    ref, _ = _stream(fresh, prompt, p, ContextShift(4))
    assert again == shifted == ref
    recomputed, fin = _stream(engine, prompt, p, ContextShift(4, recompute=True))
    assert len(recomputed) == 80 and recomputed[:len(ids)] == ids


def test_keep_whole_prompt_stops_when_nothing_can_go(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("swiglu"), n_ctx=16)
    prompt = list(range(5, 20))  # 15 of 16 slots
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids, fin = _stream(engine, prompt, p, ContextShift(-1))
    # the first token fills the last slot, the second is sampled from it; then the shift
    # would drop (16 - 15) // 2 = 0 tokens, so generation stops
    assert fin.reason == "length" and len(ids) == 2
