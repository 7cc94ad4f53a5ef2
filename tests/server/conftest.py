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
