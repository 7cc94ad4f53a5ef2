"""Fixtures: the real server (uvicorn on 127.0.0.1, port 0, in a thread) over a fake engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from sparseinfer.server.app import ServerThread, create_app

from .fake_engine import FakeEngine
from .helpers import openai_client

StartServer = Callable[..., tuple[ServerThread, FakeEngine]]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """``start_server(engine=None, **create_app_kwargs)`` -> (running server, its engine)."""
    running: list[ServerThread] = []

    def start(engine: FakeEngine | None = None, **kw) -> tuple[ServerThread, FakeEngine]:
        engine = engine or FakeEngine()
        srv = ServerThread(create_app(engine, **kw)).start()
        running.append(srv)
        return srv, engine

    yield start
    for srv in running:
        srv.stop()


REAL_MSGS = [{"role": "user", "content": "What is the capital of France?"}]
REAL_N = 3  # tokens per reference generation: keep the real-model tests fast on 2 cores


@pytest.fixture(scope="session")
def real_engine_server():
    """The real Engine on the embedded default model (SmolLM2-135M) behind a server, loaded once:
    (server, engine, chat prompt ids, greedy reference text, its FinishEvent)."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.data import default_model_path
    from sparseinfer.engine import Engine, FinishEvent, TokenEvent
    from sparseinfer.errors import SparseInferError

    try:
        path = default_model_path()
    except SparseInferError as exc:
        pytest.skip(str(exc))
    engine = Engine.load(path, n_ctx=256, threads=2)
    # the reference answer, straight from the engine (before the server's worker owns it)
    ids = engine.chat_prompt(REAL_MSGS)
    events = list(engine.stream(ids, SamplingParams(max_tokens=REAL_N, temperature=0.0)))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    with ServerThread(create_app(engine)) as srv:
        yield srv, engine, ids, text, finish


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[ServerThread, FakeEngine]]:
    """One fast server (no delays, n_ctx 256) shared by a module."""
    engine = FakeEngine()
    with ServerThread(create_app(engine)) as srv:
        yield srv, engine


@pytest.fixture
def client(fake_server) -> openai.OpenAI:
    return openai_client(fake_server[0])


@pytest.fixture
def http(fake_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server[0].url, timeout=10.0) as c:
        yield c
