"""Starting and stopping: ``serve()`` in its own process, shutdown with a stream in flight."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from sparseinfer.server.app import ServerThread, create_app

from .fake_engine import FakeEngine
from .helpers import openai_client

SERVE = """
import importlib.util, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
spec = importlib.util.spec_from_file_location("fake_engine", {path!r})
fake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake)
from sparseinfer.server.app import serve
serve(fake.FakeEngine(), port=0, api_key="k", log_level="warning")
"""


@pytest.mark.slow
def test_serve_runs_until_signalled():
    code = SERVE.format(path=str(Path(__file__).with_name("fake_engine.py")))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "serve() exited before it was ready"
            m = re.search(r"serving fake-model on http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        assert port, "no 'serving ... on' log line"
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=10)
        r = client.completions.create(model="fake-model", prompt="x", max_tokens=2)
        assert r.choices[0].text == "one two"
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM)


def test_stop_with_stream_in_flight():
    engine = FakeEngine(token_delay=0.05)
    srv = ServerThread(create_app(engine), timeout_graceful_shutdown=0.5).start()
    stream = openai_client(srv).completions.create(
        model="fake-model", prompt="x", max_tokens=200, stream=True
    )
    it = iter(stream)
    next(it)
    received = []

    def drain():
        try:
            for chunk in it:
                received.append(chunk)
        except Exception as exc:  # the connection is cut at shutdown
            received.append(exc)

    t = threading.Thread(target=drain)
    t.start()
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5
    t.join(5)
    assert not t.is_alive()
    assert engine.cancelled == 1  # the worker was told to stop, not left generating
