"""End to end: the real Engine on the embedded default model (SmolLM2-135M) behind the server.

The model is loaded once for the module; generations are greedy and a few tokens long.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from sparseinfer.config import SamplingParams
from sparseinfer.engine import FinishEvent, TokenEvent
from sparseinfer.errors import SparseInferError
from sparseinfer.server.app import ServerThread, create_app

from .helpers import assert_error, openai_client

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
N = 3  # tokens per generation: keep the module fast on 2 cores


@pytest.fixture(scope="module")
def real():
    from sparseinfer.data import default_model_path
    from sparseinfer.engine import Engine

    try:
        path = default_model_path()
    except SparseInferError as exc:
        pytest.skip(str(exc))
    engine = Engine.load(path, n_ctx=256, threads=2)
    # the reference answer, straight from the engine (before the server's worker owns it)
    ids = engine.chat_prompt(MSGS)
    events = list(engine.stream(ids, SamplingParams(max_tokens=N, temperature=0.0)))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    with ServerThread(create_app(engine)) as srv:
        yield srv, engine, ids, text, finish


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
