"""OpenAI fields beyond the basics, over the fake engine: n and prompt lists, echo + logprobs,
max_tokens 0, chat logprobs, logit_bias plumbing, server limits, /metrics and /openapi.json."""

from __future__ import annotations

import httpx
import openai
import pytest

from .fake_engine import SCRIPT, FakeEngine
from .helpers import assert_error, openai_client

MSGS = [{"role": "user", "content": "hi"}]


def words(n: int, start: int = 0) -> str:
    return " ".join(SCRIPT[start:start + n])


def fake_prompt_scores(n: int) -> list[float | None]:
    """What FakeEngine.score gives a prompt of ``n`` tokens (see its docstring)."""
    return [None] + [-(i % 5) / 10 - 0.5 for i in range(1, n)]


def test_echo_logprobs_max_tokens_zero(client):
    """lm-eval's loglikelihood request shape, with nothing generated."""
    r = client.completions.create(
        model="fake-model", prompt="abc", max_tokens=0, echo=True, logprobs=1
    )
    [choice] = r.choices
    assert choice.text == "abc"
    ids = FakeEngine().encode("abc")
    lp = choice.logprobs
    assert lp.token_logprobs == fake_prompt_scores(len(ids))
    assert lp.tokens == ["", "a", "b", "c"]  # BOS spells as nothing
    assert lp.text_offset == [0, 0, 1, 2]
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {"a": -0.6}
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert choice.finish_reason == "length"


def test_echo_logprobs_then_generated(client):
    r = client.completions.create(
        model="fake-model", prompt=[5, 6, 7], max_tokens=2, echo=True, logprobs=2
    )
    [choice] = r.choices
    ids_text = FakeEngine().decode([5, 6, 7])
    assert choice.text == ids_text + words(2)
    lp = choice.logprobs
    assert lp.token_logprobs == fake_prompt_scores(3) + [-0.1, -0.2]
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_echo_without_logprobs_and_logprobs_without_echo(client):
    r = client.completions.create(model="fake-model", prompt="xyz", max_tokens=1, echo=True)
    assert r.choices[0].text == "xyz" + words(1) and r.choices[0].logprobs is None
    r = client.completions.create(model="fake-model", prompt="xyz", max_tokens=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == words(3)
    assert lp.token_logprobs == [-0.1, -0.2, -0.3]
    assert lp.top_logprobs == [{}, {}, {}]


def test_prompt_list_and_n(client):
    r = client.completions.create(
        model="fake-model", prompt=["[[say:a b]]", "[[say:c]]"], n=2, max_tokens=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["a b", "a b", "c", "c"]
    p1, p2 = (len(FakeEngine().encode(p)) for p in ("[[say:a b]]", "[[say:c]]"))
    assert r.usage.prompt_tokens == p1 + p2  # each prompt counted once, not per choice
    assert r.usage.completion_tokens == 2 + 2 + 1 + 1


def test_token_id_prompt_batch(http):
    r = http.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_chat_n_seeds_differ_per_choice(client, fake_server):
    _, engine = fake_server
    r = client.chat.completions.create(model="fake-model", messages=MSGS, n=3, max_tokens=2,
                                       seed=10)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [p.seed for p in engine.params[-3:]] == [10, 11, 12]
    assert r.usage.completion_tokens == 6


def test_chat_stream_n(client):
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=MSGS, n=2, max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert text == {0: words(2), 1: words(2)}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [t.logprob for t in content] == [-0.1, -0.2, -0.3]
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_stream(client):
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=MSGS, max_tokens=3, logprobs=True, stream=True
        )
    )
    lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for t in c.choices[0].logprobs.content]
    assert lps == [-0.1, -0.2, -0.3]


def test_logit_bias_reaches_engine(client, fake_server):
    _, engine = fake_server
    client.chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=1, logit_bias={"7": 5, "9": -100}
    )
    [proc] = engine.processors[-1]
    assert proc.ids.tolist() == [7, 9] and proc.values.tolist() == [5.0, -100.0]


def test_limits(start_server):
    srv, engine = start_server(default_max_tokens=3, max_tokens_limit=5)
    client = openai_client(srv)
    r = client.completions.create(model="fake-model", prompt="x")
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=5)
    assert r.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="x", max_tokens=6)
    assert e.value.param == "max_tokens" and "at most 5" in e.value.message


def test_limit_without_default_caps_unset(start_server):
    srv, _ = start_server(max_tokens_limit=4)
    r = openai_client(srv).chat.completions.create(model="fake-model", messages=MSGS)
    assert r.usage.completion_tokens == 4


def test_generation_time_limit(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.05), max_generation_seconds=0.2)
    client = openai_client(srv)
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=200)
    assert r.choices[0].finish_reason == "length"
    assert 0 < r.usage.completion_tokens < 200
    chunks = list(client.completions.create(model="fake-model", prompt="x", max_tokens=200,
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_limits_rejected_when_not_positive():
    from sparseinfer.server.app import create_app

    with pytest.raises(ValueError, match="max_tokens_limit"):
        create_app(FakeEngine(), max_tokens_limit=0)


def test_metrics(start_server):
    srv, _ = start_server()
    client = openai_client(srv)
    client.completions.create(model="fake-model", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="x", max_tokens=-1)
    text = httpx.get(srv.url + "/metrics", timeout=5).text
    assert 'sparseinfer_requests_total{route="/v1/completions",status="200"} 1.0' in text
    assert 'sparseinfer_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert "sparseinfer_generated_tokens_total 3.0" in text
    assert "sparseinfer_queue_depth 0.0" in text
    assert "sparseinfer_time_to_first_token_seconds_count 1.0" in text
    assert "sparseinfer_inter_token_latency_seconds_count 2.0" in text


def test_openapi_declares_bodies_and_real_errors(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/completions", "CompletionRequest")):
        op = spec["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "messages" in schemas[model]["properties"] or "prompt" in schemas[model]["properties"]
        assert {"200", "400", "413", "429"} <= set(op["responses"])
        err = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/ErrorResponse"}
    for item in spec["paths"].values():
        for op in item.values():
            assert "422" not in op["responses"]
    assert "HTTPValidationError" not in schemas


def test_validation_errors_are_400_not_422(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "n": "two"}), 400, param="n")


def test_serve_flags_parse():
    from sparseinfer.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "-np", "4", "--default-max-tokens", "8", "--max-tokens-limit", "16",
         "--max-generation-seconds", "2.5", "--no-cache-prompt"])
    assert (args.parallel, args.default_max_tokens, args.max_tokens_limit,
            args.max_generation_seconds, args.no_cache_prompt) == (4, 8, 16, 2.5, True)
    args = build_parser().parse_args(["serve"])
    assert (args.parallel, args.default_max_tokens, args.max_tokens_limit,
            args.max_generation_seconds, args.no_cache_prompt) == (1, 1024, 0, 300.0, False)


def test_stream_options_obfuscation(http):
    body = {"prompt": "x", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert http.post("/v1/completions", json=body).status_code == 200
    body["stream_options"]["include_obfuscation"] = True
    assert_error(http.post("/v1/completions", json=body), 400,
                 param="stream_options.include_obfuscation")
