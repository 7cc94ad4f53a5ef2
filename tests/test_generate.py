"""Sampling, penalties, stop conditions and streaming, checked against brute-force references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sparseinfer.config import SamplingParams
from sparseinfer.engine import Engine, FinishEvent, StopStrings, TokenEvent
from sparseinfer.errors import ContextOverflowError
from sparseinfer.generate import Uniforms, apply_penalties, sample
from sparseinfer.models.loading import load_model

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])


def _allowed(p: SamplingParams) -> dict[int, float]:
    """Brute force: the distribution llama.cpp's top-k -> top-p -> min-p -> temp chain samples."""
    probs = torch.softmax(LOGITS, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if p.top_k:
        order = order[: p.top_k]
    z = sum(probs[i] for i in order)
    kept, cum = [], 0.0
    for i in order:
        kept.append(i)
        cum += probs[i] / z
        if cum >= p.top_p:
            break
    top = probs[kept[0]]
    kept = [i for i in kept if probs[i] >= p.min_p * top] or kept[:1]
    w = {i: math.exp(LOGITS[i].item() / p.temperature) for i in kept}
    s = sum(w.values())
    return {i: v / s for i, v in w.items()}


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0),
    SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1),
])
def test_sampling_distribution_matches_brute_force(params):
    want = _allowed(params)
    rng = Uniforms(0)
    n = 6000
    counts = Counter(sample(LOGITS, params, rng) for _ in range(n))
    assert set(counts) <= set(want), f"sampled outside the allowed set: {counts} vs {want}"
    for i, prob in want.items():
        assert abs(counts[i] / n - prob) < 0.03, (i, counts[i] / n, prob)


def test_uniforms_are_the_seeded_generators_blocks():
    """A sequence's draws are torch's seeded uniforms, block after block, whatever the count."""
    g = torch.Generator().manual_seed(5)
    want = torch.cat([torch.rand(Uniforms.BLOCK, generator=g, dtype=torch.float64)
                      for _ in range(3)]).tolist()
    u = Uniforms(5)
    got = [u() for _ in range(2 * Uniforms.BLOCK + 7)]
    assert got == want[:len(got)]
    assert all(0.0 <= x < 1.0 for x in got)
    assert Uniforms(6)() != want[0]


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), None) == 0
    assert sample(LOGITS.flip(0), SamplingParams(temperature=0), None) == 6


def test_repeat_penalty_llama_cpp_rule():
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=2)
    out = apply_penalties(LOGITS, [0, 5, 1, 6], p)  # only the last two (1, 6) are penalised
    want = LOGITS.clone()
    want[1] = LOGITS[1] / 2.0  # positive logit: divided
    want[6] = LOGITS[6] * 2.0  # negative logit: multiplied
    assert torch.equal(out, want)


def test_presence_and_frequency_penalties():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, [2, 2, 2, 4], p)
    want = LOGITS.clone()
    want[2] -= 3 * 0.25 + 0.5
    want[4] -= 1 * 0.25 + 0.5
    assert torch.allclose(out, want)


def test_stop_strings_hold_back_prefixes():
    s = StopStrings(("END", "\n\n"))
    out = []
    for piece in ["Hel", "lo E", "N", "ding", " ok\n", "\nmore"]:
        text, hit = s.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello ENding ok"
    assert hit and s.hit == "\n\n"
    first = StopStrings(("b", "ab"))  # the earliest match in the text, not in the list
    assert first.push("xaby") == ("x", True) and first.hit == "ab"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return Engine(load_model(tiny_model_dir("swiglu")), n_ctx=128)


def _run(engine, prompt, params):
    events = list(engine.stream(engine.encode(prompt), params))
    assert isinstance(events[-1], FinishEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return "".join(e.text for e in events[:-1]), [e.token_id for e in events[:-1] if e.token_id >= 0], events[-1]


def test_same_seed_same_text(tiny_engine):
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=42, ignore_eos=True)
    a, ids_a, _ = _run(tiny_engine, "Emma Woodhouse", p)
    b, ids_b, _ = _run(tiny_engine, "Emma Woodhouse", p)
    c, ids_c, _ = _run(tiny_engine, "Emma Woodhouse", SamplingParams(
        max_tokens=30, temperature=1.0, seed=43, ignore_eos=True))
    assert ids_a == ids_b and a == b
    assert ids_a != ids_c


def test_streamed_text_equals_decode_and_max_tokens(tiny_engine):
    p = SamplingParams(max_tokens=25, temperature=0.9, seed=1, ignore_eos=True)
    text, ids, fin = _run(tiny_engine, "It was", p)
    assert len(ids) == 25 and fin.completion_tokens == 25 and fin.reason == "length"
    assert text == tiny_engine.decode(ids)


def test_stop_string_cuts_output(tiny_engine):
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full, _, _ = _run(tiny_engine, "Mr. Knightley", p)
    stop = full[10:13]
    assert stop and stop in full
    cut, _, fin = _run(tiny_engine, "Mr. Knightley", SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))
    assert fin.reason == "stop" and fin.stop_string == stop
    assert cut == full[: full.index(stop)]


def test_eos_ends_generation(tiny_engine):
    """Force EOS by giving it an overwhelming logit through a negative presence penalty
    (the prompt is EOS alone, so EOS is the only token the penalty boosts)."""
    eos = tiny_engine.tokenizer.eos_id
    prompt = [eos]
    p = SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=-1e4)
    _, ids, fin = _run_ids(tiny_engine, prompt, p)
    assert fin.reason == "stop" and ids == [] and fin.stop_string is None


def _run_ids(engine, prompt_ids, params):
    events = list(engine.stream(prompt_ids, params))
    return "", [e.token_id for e in events[:-1] if e.token_id >= 0], events[-1]


def test_prefix_cache_reuse_gives_same_result(tiny_engine):
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, _, _ = _run(tiny_engine, "Emma was handsome, clever and rich", p)
    _run(tiny_engine, "Emma was handsome, quiet", p)  # shares a prefix, evicts the tail
    again, _, _ = _run(tiny_engine, "Emma was handsome, clever and rich", p)
    fresh = Engine(tiny_engine.loaded, n_ctx=128)
    ref, _, _ = _run(fresh, "Emma was handsome, clever and rich", p)
    assert first == again == ref


def test_forget_prefix_prefills_the_whole_prompt(tiny_engine):
    """Reuse prefills only the new tail; after forget_prefix the whole prompt runs again."""
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = tiny_engine.encode("Emma was handsome, clever and rich")
    fed = []
    hook = tiny_engine.model.register_forward_pre_hook(lambda m, args: fed.append(args[0].shape[1]))
    try:
        _run_ids(tiny_engine, ids, p)
        fed.clear()
        _run_ids(tiny_engine, ids, p)
        reused = fed[0]
        fed.clear()
        tiny_engine.forget_prefix()
        _run_ids(tiny_engine, ids, p)
    finally:
        hook.remove()
    assert reused < len(ids) and fed[0] == len(ids)


def test_context_overflow(tiny_engine):
    with pytest.raises(ContextOverflowError, match="128"):
        list(tiny_engine.stream(list(range(3, 200)), SamplingParams()))


def test_generation_stops_at_context_end(tiny_engine):
    prompt = tiny_engine.encode("word " * 10)
    p = SamplingParams(max_tokens=-1, temperature=0.0, ignore_eos=True)
    _, ids, fin = _run_ids(tiny_engine, prompt, p)
    assert fin.reason == "length" and len(prompt) + len(ids) == 128
