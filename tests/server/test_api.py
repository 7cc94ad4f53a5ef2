"""The OpenAI API over the fake engine, driven by the official ``openai`` client."""

from __future__ import annotations

import time

import httpx
import pytest

from .fake_engine import SCRIPT, FakeEngine

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def words(n: int) -> str:
    return " ".join(SCRIPT[:n])


def test_models(client, fake_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"


def test_health(http):
    body = http.get("/health").json()
    assert body == {
        "status": "ok",
        "model": "fake-model",
        "running": 0,
        "queued": 0,
        "max_queue": 16,
    }


def test_chat(client, fake_server):
    _, engine = fake_server
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "fake-model"
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == words(3)
    assert choice.finish_reason == "length"
    # the model's own template was used, and usage counts its tokens
    assert engine.started[-1] == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert r.usage.prompt_tokens == len(FakeEngine().encode(engine.started[-1]))
    assert r.usage.completion_tokens == 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3


def test_chat_natural_stop_and_content_parts(client):
    msgs = [
        {"role": "developer", "content": "x"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[[say:hello "},
                {"type": "text", "text": "world]]"},
            ],
        },
    ]
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=50)
    assert r.choices[0].message.content == "hello world"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=5, max_completion_tokens=2
    )
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("stop", ["four", ["nothing", "four"], [" fo"]])
def test_stop_strings(client, stop):
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=8, stop=stop)
    content = r.choices[0].message.content
    assert content.rstrip() == words(3)
    assert "fo" not in content
    assert r.choices[0].finish_reason == "stop"


def test_sampling_params_mapped(client, fake_server):
    _, engine = fake_server
    client.chat.completions.create(
        model="fake-model",
        messages=MSGS,
        max_tokens=4,
        temperature=0.0,
        top_p=0.5,
        seed=-1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        stop="zz",
        extra_body={"top_k": 7, "min_p": 0.1, "repeat_penalty": 1.1},
    )
    p = engine.params[-1]
    assert (p.max_tokens, p.temperature, p.top_p) == (4, 0.0, 0.5)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.25)
    assert (p.top_k, p.min_p, p.repeat_penalty) == (7, 0.1, 1.1)
    assert p.stop == ("zz",)
    assert p.seed is not None and 0 <= p.seed < 1 << 63
    client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1, seed=42)
    assert engine.params[-1].seed == 42


def test_unset_sampling_fields_keep_engine_defaults(client, fake_server):
    from sparseinfer.config import SamplingParams

    _, engine = fake_server
    client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
    d = SamplingParams()
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (d.temperature, d.top_p, d.top_k, None)


def test_model_may_be_omitted(http):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == words(2)


def test_max_tokens_clamped_to_context(client, fake_server):
    """Documented choice: max_tokens beyond the room left by the prompt is clamped to it."""
    _, engine = fake_server
    for max_tokens in (10**12, None):
        r = client.completions.create(model="fake-model", prompt="abc", max_tokens=max_tokens)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == 4
        assert r.usage.completion_tokens == engine.n_ctx - 4


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == words(4)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)


def test_chat_stream_usage(client):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=MSGS,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 3
    assert last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stream_equals_non_stream(client):
    kw = dict(model="fake-model", messages=MSGS, max_tokens=6, stop=["five"])
    full = client.chat.completions.create(**kw)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == full.choices[0].message.content


def test_completions(client, fake_server):
    _, engine = fake_server
    r = client.completions.create(model="fake-model", prompt="Once upon", max_tokens=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == words(2)
    assert r.choices[0].finish_reason == "length"
    assert engine.started[-1] == "Once upon"
    assert r.usage.prompt_tokens == 1 + len("Once upon")  # BOS + bytes


def test_completions_prompt_forms(client, fake_server):
    _, engine = fake_server
    r = client.completions.create(model="fake-model", prompt=["[[say:ok]]"], max_tokens=5)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ok", "stop")
    ids = FakeEngine().encode("[[say:ids]]")
    r = client.completions.create(model="fake-model", prompt=ids, max_tokens=5)
    assert r.choices[0].text == "ids"
    assert r.usage.prompt_tokens == len(ids)


def test_completions_stream_usage(client):
    chunks = list(
        client.completions.create(
            model="fake-model",
            prompt="x",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == words(3)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3


def test_sse_wire_format(fake_server):
    srv, _ = fake_server
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_engine_used_from_one_thread(client, fake_server):
    _, engine = fake_server
    client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
    assert len(engine.threads) == 1
    assert not engine.overlap


def test_streamed_tokens_are_not_held_back(fake_server):
    """Accepted sockets get TCP_NODELAY (else Nagle + delayed ACK add ~40 ms per token)."""
    import socket

    srv, _ = fake_server
    with httpx.Client(base_url=srv.url) as c:  # keeps its connection open while we look
        assert c.get("/health").status_code == 200
        conns = list(srv._server.server_state.connections)
        socks = [conn.transport.get_extra_info("socket") for conn in conns]
        assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)


def test_stream_is_incremental(start_server):
    srv, _ = start_server(FakeEngine(token_delay=0.1))
    body = {"prompt": "x", "max_tokens": 4, "stream": True}
    arrivals = []
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5  # 4 tokens + the finish chunk
    assert arrivals[3] - arrivals[0] > 0.2  # tokens arrive as made, not all at the end
