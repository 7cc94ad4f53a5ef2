"""Queueing: bounded FIFO, 429 when full, disconnects free slots, /health stays responsive."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from .fake_engine import FakeEngine
from .helpers import assert_error, health, openai_client, wait_until

MSGS = [{"role": "user", "content": "hi"}]


def long_stream(client: openai.OpenAI, tag: str = "long", max_tokens: int = 200):
    """Start a streaming chat and return it once its first content token has arrived."""
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": tag}],
        max_tokens=max_tokens,
        stream=True,
    )
    it = iter(stream)
    next(it)  # role chunk
    next(it)  # first token
    return stream, it


def test_queue_full_gets_429(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.05), max_queue=1)
    client = openai_client(srv)
    running, _ = long_stream(client)
    waiting = []
    t = threading.Thread(
        target=lambda: waiting.append(
            client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)
        )
    )
    t.start()
    assert wait_until(lambda: health(srv)["queued"] == 1)

    r = httpx.post(srv.base_url + "/chat/completions", json={"messages": MSGS})
    err = assert_error(r, 429, code="rate_limit_exceeded")
    assert r.headers["retry-after"] == "1"
    assert "max_queue=1" in err["message"]
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="fake-model", prompt="x", stream=True)

    running.close()  # frees the running slot: the waiting request is served
    t.join(10)
    assert waiting and waiting[0].choices[0].message.content == "one two"
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
    assert r.choices[0].message.content == "one"


def test_disconnect_mid_stream_frees_slot(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.05), max_queue=0)
    client = openai_client(srv)
    stream, it = long_stream(client)  # 200 tokens * 50 ms = 10 s if nobody stops it
    next(it)
    stream.close()
    t0 = time.monotonic()
    assert wait_until(lambda: health(srv)["running"] == 0, timeout=2.0)
    assert engine.cancelled == 1
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)
    assert r.choices[0].message.content == "one two"
    assert time.monotonic() - t0 < 2.0  # vs ~10 s if the generation kept its slot


def test_disconnect_while_waiting_frees_slot(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.05), max_queue=1)
    client = openai_client(srv)
    running, _ = long_stream(client)
    # a raw client that sends a request, waits in the queue, then hangs up
    body = b'{"messages": [{"role": "user", "content": "never"}], "max_tokens": 1}'
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert wait_until(lambda: health(srv)["queued"] == 1)
    sock.close()
    assert wait_until(lambda: health(srv)["queued"] == 0, timeout=2.0)
    # the freed slot takes a new request at once (else: 429)
    waiting = []
    t = threading.Thread(
        target=lambda: waiting.append(
            client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)
        )
    )
    t.start()
    assert wait_until(lambda: health(srv)["queued"] == 1)
    running.close()
    t.join(10)
    assert waiting[0].choices[0].message.content == "one"
    assert "never" not in "".join(engine.started)  # the abandoned request never ran


def test_non_stream_client_timeout_cancels_generation(start_server):
    """A client that gives up ends its generation: within 5 s (a 2-core machine under a test
    run can take seconds to notice the closed socket), far before the 20 s it would run. A
    generation that began was cancelled; on a loaded machine the request may still be on its
    way to the engine when the client gives up, and then none begins (a CI run saw that)."""
    srv, engine = start_server(FakeEngine(token_delay=0.05), max_queue=0)
    impatient = openai_client(srv, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=400)
    assert wait_until(lambda: health(srv)["running"] == 0, timeout=5.0)
    assert len(engine.started) <= 1 and engine.cancelled == len(engine.started)


def test_health_and_models_during_generation(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.05))
    client = openai_client(srv)
    stream, _ = long_stream(client)
    for _ in range(5):
        t0 = time.monotonic()
        h = health(srv)
        assert client.models.list().data[0].id == "fake-model"
        assert time.monotonic() - t0 < 1.0  # (a blocked event loop would take seconds)
        assert h["running"] == 1
    stream.close()


def test_fifo_fairness(start_server):
    """Requests start in arrival order, whatever the thread scheduling of their clients."""
    srv, engine = start_server(FakeEngine(token_delay=0.02), max_queue=8)
    client = openai_client(srv)
    first, _ = long_stream(client, tag="first", max_tokens=230)  # ~5 s unless released
    results: dict[int, str] = {}
    threads = []
    for i in range(6):

        def ask(i=i):
            r = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": f"req-{i}"}], max_tokens=3
            )
            results[i] = r.choices[0].message.content

        t = threading.Thread(target=ask)
        t.start()
        threads.append(t)
        assert wait_until(lambda n=i + 1: health(srv)["queued"] == n)  # arrival order is now fixed
    first.close()  # release the worker: the queue drains in order
    for t in threads:
        t.join(10)
    assert results == {i: "one two three" for i in range(6)}
    order = [p for p in engine.started if "req-" in p or "first" in p]
    assert [("first" if "first" in p else p.split("req-")[1][0]) for p in order] == [
        "first",
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
    ]
    assert len(engine.threads) == 1 and not engine.overlap


def test_many_concurrent_clients_all_answered(start_server):
    srv, engine = start_server(FakeEngine(token_delay=0.002), max_queue=16)
    client = openai_client(srv)
    out: dict[int, str] = {}

    def ask(i: int) -> None:
        if i % 2:
            r = client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": f"[[say:n{i}]]"}],
                max_tokens=5,
            )
            out[i] = r.choices[0].message.content
        else:
            out[i] = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="fake-model", prompt=f"[[say:n{i}]]", max_tokens=5, stream=True
                )
                if c.choices
            )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert out == {i: f"n{i}" for i in range(12)}
    assert len(engine.threads) == 1 and not engine.overlap
