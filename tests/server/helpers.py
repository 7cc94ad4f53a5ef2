"""Small helpers shared by the server tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai

from sparseinfer.server.app import ServerThread


def openai_client(srv: ServerThread, api_key: str = "unused", **kw) -> openai.OpenAI:
    """The official client pointed at ``srv``; no retries, so a 429 surfaces as an error."""
    kw.setdefault("timeout", 10.0)
    return openai.OpenAI(base_url=srv.base_url, api_key=api_key, max_retries=0, **kw)


def health(srv: ServerThread) -> dict:
    return httpx.get(srv.url + "/health", timeout=5.0).json()


def wait_until(
    predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005
) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def event_classes(union) -> dict[str, type]:
    """An SDK's stream event models by their ``type``, from its union of every event (an
    ``Annotated`` union, as openai's and anthropic's are)."""
    from typing import get_args

    return {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(union)[0])}


def streamed_events(url: str, body: dict, classes: dict[str, type]) -> list[dict]:
    """``body`` POSTed to ``url`` with ``stream: true``: its SSE events' data, each one's
    ``event:`` line naming its type, each validated (not merely constructed, as an SDK does)
    against ``classes[type]``."""
    import json

    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]
    for d in data:
        classes[d["type"]].model_validate(d)
    return data


def assert_error(
    resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> dict:
    """``resp`` is an OpenAI-shaped error with ``status`` (and ``param`` / ``code`` if given)."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0].split("[")[0] in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err
