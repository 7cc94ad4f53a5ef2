"""Bad input gets an OpenAI-shaped 4xx naming the field, and never hurts the server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .helpers import assert_error

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat_body(**kw) -> dict:
    return {"model": "fake-model", "messages": MSGS, "max_tokens": 2, **kw}


@pytest.fixture(autouse=True)
def server_still_serves(http):
    """After every bad request, the next good one is served normally."""
    yield
    r = http.post(CHAT, json=chat_body())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "one two"


def test_unknown_model_with_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSGS)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert "gpt-9" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize(
    "body, param",
    [
        (chat_body(messages=[]), "messages"),
        ({"model": "fake-model"}, "messages"),
        (chat_body(messages="hi"), "messages"),
        (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0].type",
        ),
        (chat_body(max_tokens="5"), "max_tokens"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(max_tokens=-1), "max_tokens"),
        (chat_body(max_tokens=2.5), "max_tokens"),
        (chat_body(max_completion_tokens=0), "max_completion_tokens"),
        (chat_body(temperature=7), "temperature"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(presence_penalty=3), "presence_penalty"),
        (chat_body(frequency_penalty=None, seed="x"), "seed"),
        (chat_body(stop=["a", 1]), "stop[1]"),
        (chat_body(stream="yes"), "stream"),
        (chat_body(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (chat_body(n=0), "n"),
        (chat_body(n=17), "n"),
        (chat_body(n="1"), "n"),
        (chat_body(model=123), "model"),
        (chat_body(logprobs="yes"), "logprobs"),
        (chat_body(top_logprobs=3), "top_logprobs"),  # without logprobs: true
        (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat_body(logit_bias={"x": 1}), "logit_bias"),
        (chat_body(logit_bias={"\u00b9": 1}), "logit_bias"),  # a superscript one: not a token id
        (chat_body(logit_bias={"5": 101}), "logit_bias"),
        (chat_body(logit_bias={"999999": 1}), "logit_bias"),
        (chat_body(tool_choice="required"), "tool_choice"),  # without tools
        (chat_body(response_format={"type": "xml"}), "response_format"),
        (chat_body(functions=[{"name": "f"}]), "functions"),  # unknown: a 400, not ignored
        (chat_body(audio={"voice": "x"}), "audio"),
        (
            chat_body(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice",
        ),
    ],
)
def test_chat_bad_fields(http, body, param):
    assert_error(http.post(CHAT, json=body), 400, param=param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "fake-model"}, "prompt"),
        ({"prompt": ["a"] * 9, "n": 2}, "prompt"),  # 18 choices > 16
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0, "stream": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": None, "n": 0}, "n"),
        ({"prompt": "x", "cache_prompt": True}, "cache_prompt"),
    ],
)
def test_completions_bad_fields(http, body, param):
    assert_error(http.post(COMP, json=body), 400, param=param)


def test_bad_values_with_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSGS, n=30)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=[])
    assert e.value.param == "messages"


def test_prompt_longer_than_context(client, fake_server, http):
    _, engine = fake_server
    long = "x" * (engine.n_ctx + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": long}]
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt=long, stream=True)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    # exactly full: no room for one token
    exact = "x" * (engine.n_ctx - 1)  # + BOS = n_ctx
    assert_error(http.post(COMP, json={"prompt": exact}), 400, code="context_length_exceeded")
    r = http.post(COMP, json={"prompt": exact[1:]})  # room for one token
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"{not json", "invalid_json"),
        (b'{"messages": [', "invalid_json"),
        (b"", "invalid_json"),
        (b"   ", "invalid_json"),
        (b"[]", None),
        (b"null", None),
        (b'"a string"', None),
        (b"\xff\xfe{}", "invalid_encoding"),
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid_encoding"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_json"),
    ],
)
def test_malformed_bodies(http, raw, code):
    for path in (CHAT, COMP):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, code=code)


def test_huge_body(fake_server, http):
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (2 << 20)}])).encode()
    assert_error(http.post(CHAT, content=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(40):
            yield b"x" * (64 << 10)

    assert_error(http.post(COMP, content=chunked()), 413, code="request_too_large")


@pytest.mark.parametrize("declared", [True, False])
def test_huge_body_readable_413(fake_server, declared):
    """Past the drain limit (64 MiB) the server stops reading and closes: the client still
    reads the 413 and its message, with or without a Content-Length."""
    size = 100 << 20

    def chunked():
        for _ in range(size >> 20):
            yield b"x" * (1 << 20)

    content = b"x" * size if declared else chunked()
    with httpx.Client(base_url=fake_server[0].url, timeout=30.0) as c:
        err = assert_error(c.post(COMP, content=content), 413, code="request_too_large")
    assert "larger than the limit of 1048576 bytes" in err["message"]
    assert ("104857600 bytes" if declared else "more than") in err["message"]
    assert httpx.get(fake_server[0].url + "/health", timeout=5).json()["status"] == "ok"


def test_body_just_under_limit_is_fine(http):
    body = json.dumps({"prompt": "[[say:ok]]" + " " * ((1 << 20) - 200)}).encode()
    assert len(body) < 1 << 20
    r = http.post(COMP, content=body)
    # the prompt is far longer than the fake context: a clean 400, after reading it all
    assert_error(r, 400, code="context_length_exceeded")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_error(http.get(CHAT), 405, code="method_not_allowed")
    assert_error(http.delete("/v1/models"), 405)


def test_template_rejection_is_400(http):
    r = http.post(CHAT, json=chat_body(messages=[{"role": "tool", "content": "x"}]))
    assert_error(r, 400, param="messages")


def test_engine_failure_non_stream(http):
    r = http.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": "[[fail]]"}], max_tokens=10)
    )
    err = assert_error(r, 500)
    assert err["type"] == "server_error"


def test_engine_failure_mid_stream(client):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "[[fail]]"}],
        max_tokens=10,
        stream=True,
    )
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert "fake engine failure" in e.value.message
    assert "one" in got  # tokens before the failure arrived


def test_wrong_bodies_through_client_with_extra_body(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="fake-model", messages=MSGS, extra_body={"max_tokens": "lots"}
        )
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
