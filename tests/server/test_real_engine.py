"""End to end: the real Engine on the embedded default model (SmolLM2-135M) behind the server.

The model is loaded once for the module; generations are greedy and a few tokens long.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from .conftest import REAL_MSGS as MSGS
from .conftest import REAL_N as N
from .helpers import assert_error, openai_client

pytestmark = pytest.mark.slow


@pytest.fixture
def real(real_engine_server):
    # every test starts without prefix reuse: the reference text was prefilled whole, and a
    # prompt token decoded instead of prefilled rounds differently (near-ties flip the argmax
    # of a tiny model)
    real_engine_server[1].forget_prefix()
    return real_engine_server


def test_models(real):
    srv, engine, *_ = real
    assert [m.id for m in openai_client(srv).models.list().data] == [engine.name]


def test_chat_matches_engine(real):
    srv, engine, ids, text, finish = real
    r = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=MSGS, max_tokens=N, temperature=0
    )
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("length" if finish.reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == finish.completion_tokens


def test_chat_stream_matches_engine(real):
    srv, engine, ids, text, finish = real
    chunks = list(
        openai_client(srv, timeout=60).chat.completions.create(
            model=engine.name,
            messages=MSGS,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == finish.completion_tokens


def test_completions_stream(real):
    srv, engine, *_ = real
    chunks = list(
        openai_client(srv, timeout=60).completions.create(
            model=engine.name,
            prompt="The capital of France is",
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens <= 2


def test_errors_with_real_engine(real):
    srv, engine, *_ = real
    client = openai_client(srv, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=engine.name, messages=[{"role": "user", "content": "word " * 400}]
        )
    assert e.value.code == "context_length_exceeded"
    r = httpx.post(srv.base_url + "/completions", json={"prompt": [1, 10**7]}, timeout=60)
    assert_error(r, 400, param="prompt")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-" + engine.name, prompt="x")


def test_embeddings_real(real, smollm2_hf):
    """The official client's (base64) vectors against transformers' float32 reading of the same
    file (mean of the final-normed hidden states, unit length): the served engine's default
    4-bit weights move them a little. A chat after it still gives the reference answer (the
    cache it overwrote is not reused)."""
    srv, engine, ids, text, _ = real
    texts = ["The capital of France is Paris.", "Pride and Prejudice was written by Jane Austen."]
    r = openai_client(srv, timeout=60).embeddings.create(model=engine.name, input=texts)
    for d, t in zip(r.data, texts):
        tokens = engine.encode(t)
        with torch.no_grad():
            h = smollm2_hf.model(torch.tensor([tokens])).last_hidden_state[0].mean(0)
        got = torch.tensor(d.embedding)
        assert abs(float(got.norm()) - 1) < 1e-5
        assert float(got @ (h / h.norm())) > 0.99
    assert r.usage.prompt_tokens == sum(len(engine.encode(t)) for t in texts)
    chat = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=MSGS, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == text


# -- determinism and sampling edge cases --------------------------------------------------------


def test_seed_reproducible_whatever_ran_before(real):
    """Same request + seed -> same text, also when the previous request shared a prefix (the
    KV reuse path) or was the very same request."""
    srv, engine, *_ = real
    client = openai_client(srv, timeout=60)
    body = dict(model=engine.name, prompt="Once upon a time", max_tokens=6, temperature=1.0,
                seed=1234)
    first = client.completions.create(**body).choices[0].text
    assert client.completions.create(**body).choices[0].text == first
    client.completions.create(model=engine.name, prompt="Once upon a time there", max_tokens=2)
    assert client.completions.create(**body).choices[0].text == first
    chat = dict(model=engine.name, messages=MSGS, max_tokens=4, temperature=1.0, seed=99)
    reply = client.chat.completions.create(**chat).choices[0].message.content
    client.chat.completions.create(model=engine.name, messages=MSGS + MSGS, max_tokens=2)
    assert client.chat.completions.create(**chat).choices[0].message.content == reply


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-7])
def test_tiny_temperature_is_greedy(real, temperature):
    srv, engine, ids, text, _ = real
    client = openai_client(srv, timeout=60)
    r = client.chat.completions.create(model=engine.name, messages=MSGS, max_tokens=N,
                                       temperature=temperature)
    assert r.choices[0].message.content == text  # the greedy reference
    chunks = list(client.completions.create(model=engine.name, prompt="Hello", max_tokens=2,
                                            temperature=temperature, stream=True))
    greedy = client.completions.create(model=engine.name, prompt="Hello", max_tokens=2,
                                       temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.choices[0].text


# -- logprobs against a direct forward pass ------------------------------------------------------


def direct_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one forward pass of the model on a fresh cache
    (not through Engine.score / generate.score)."""
    model = engine.model
    cache = model.new_cache(1, engine.n_ctx)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), 0, cache)[0]  # (T, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_prompt_logprobs_match_direct_forward(real):
    srv, engine, *_ = real
    prompt = "The cat sat on the mat and looked at the dog."
    r = httpx.post(srv.base_url + "/completions", timeout=60, json={
        "model": engine.name, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = engine.encode(prompt)
    ref = direct_logprobs(engine, ids)
    assert lp["token_logprobs"][0] is None
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), ref, atol=1e-3)
    assert r.json()["choices"][0]["text"] == prompt
    # the best alternative is at least as likely as the actual token
    for got, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) <= 3 and max(top.values()) >= got - 1e-5


def test_generated_logprobs_match_direct_forward(real):
    srv, engine, *_ = real
    r = openai_client(srv, timeout=60).completions.create(
        model=engine.name, prompt="The capital of France is", max_tokens=3, temperature=0,
        logprobs=2)
    ids = engine.encode("The capital of France is")
    lp = r.choices[0].logprobs
    gen = [engine.encode(t, add_bos=False) for t in lp.tokens]
    flat = [t for g in gen for t in g]
    ref = direct_logprobs(engine, ids + flat)[len(ids) - 1:]
    # generated tokens come from the single-token decode path (fused C block), the reference
    # from a whole-sequence forward. Each layer's input is rounded to int8 blocks, so a last-bit
    # difference can change a code and the logprobs move chaotically: scaling the embeddings by
    # 1 +- 1e-6 noise moved the third token's by up to 0.14 nats (avx2 kernels, AMD Zen 1), and
    # the two paths differed by 0.02 (avx2) and 0.10 nats (avx2_128). A wrong token's logprob
    # would be off by far more.
    assert torch.allclose(torch.tensor(lp.token_logprobs), ref, atol=0.25)
    # greedy: each token is its position's best
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(max(top.values()), abs=1e-6)


def test_chat_logprobs_real(real):
    srv, engine, ids, text, _ = real
    r = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=MSGS, max_tokens=N, temperature=0, logprobs=True,
        top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == text
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


# -- logit_bias and constrained decoding ---------------------------------------------------------


def test_logit_bias(real):
    srv, engine, *_ = real
    client = openai_client(srv, timeout=60)
    [banana] = engine.encode(" banana", add_bos=False)
    r = client.completions.create(model=engine.name, prompt="Hello", max_tokens=3,
                                  temperature=0, logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 3
    greedy = client.completions.create(model=engine.name, prompt="Hello", max_tokens=1,
                                       temperature=0, logprobs=0).choices[0].logprobs.tokens[0]
    [first] = engine.encode(greedy, add_bos=False)
    r = client.completions.create(model=engine.name, prompt="Hello", max_tokens=1,
                                  temperature=0, logit_bias={str(first): -100})
    assert r.choices[0].text != greedy


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "country": {"type": "string", "enum": ["France", "England", "Italy"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_response_format_json_schema(real):
    srv, engine, *_ = real
    r = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=[{"role": "user", "content": "Name a city, as JSON."}],
        max_tokens=40, temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"city", "country"}
    assert obj["city"] in CITY["properties"]["city"]["enum"]
    assert r.choices[0].finish_reason == "stop"


def test_response_format_json_object(real):
    srv, engine, *_ = real
    r = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=[{"role": "user", "content": "Give me an empty JSON object"}],
        max_tokens=30, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert text.startswith("{")


def test_bad_schema_is_400(real):
    srv, engine, *_ = real
    r = httpx.post(srv.base_url + "/chat/completions", timeout=60, json={
        "messages": MSGS, "max_tokens": 2,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert_error(r, 400, param="response_format.json_schema")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_call(real, choice):
    srv, engine, *_ = real
    r = openai_client(srv, timeout=60).chat.completions.create(
        model=engine.name, messages=ASK, max_tokens=30, temperature=0, tools=[WEATHER],
        tool_choice=choice)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")


def test_tool_call_auto_and_stream(real):
    srv, engine, *_ = real
    client = openai_client(srv, timeout=60)
    r = client.chat.completions.create(model=engine.name, messages=ASK, max_tokens=30,
                                       temperature=0, tools=[WEATHER])  # auto
    msg = r.choices[0].message
    assert (msg.tool_calls is None) == (r.choices[0].finish_reason != "tool_calls")
    if msg.tool_calls is None:
        assert not msg.content.startswith("{")
    chunks = list(client.chat.completions.create(
        model=engine.name, messages=ASK, max_tokens=30, temperature=0, tools=[WEATHER],
        tool_choice="required", stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the conversation continues with the tool's answer
    r = client.chat.completions.create(
        model=engine.name, max_tokens=3, temperature=0,
        messages=ASK + [
            {"role": "assistant", "tool_calls": [{"id": calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"},
        ])
    assert r.choices[0].message.content
