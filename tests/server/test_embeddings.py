"""``POST /v1/embeddings`` over the fake engine: the official client's requests (base64 by
default) and plain floats, every input form, pooling, and each bad request as a 400 naming
the field. The numbers themselves are tested against transformers in tests/test_embeddings.py
and, through the server, in test_real_engine.py."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import pytest

from .fake_engine import BOS, OFFSET, FakeEngine
from .helpers import assert_error


def _ids(text: str) -> list[int]:
    return [BOS] + [b + OFFSET for b in text.encode()]


def _want(ids: list[int], pooling: str = "mean") -> list[float]:
    v = [float(len(ids)), float(sum(ids)), 1.0 if pooling == "mean" else 2.0]
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def test_official_client_base64(client, fake_server):
    r = client.embeddings.create(model=fake_server[1].name, input=["Hello", "a longer text"])
    assert [d.index for d in r.data] == [0, 1]
    for d, text in zip(r.data, ["Hello", "a longer text"]):
        np.testing.assert_allclose(d.embedding, _want(_ids(text)), rtol=1e-6)  # float32
    assert r.model == "fake-model"
    assert r.usage.prompt_tokens == r.usage.total_tokens == 6 + 14


@pytest.mark.parametrize("given, ids", [
    ("Hi", [_ids("Hi")]),
    (["Hi", "there"], [_ids("Hi"), _ids("there")]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_input_forms_as_floats(http, given, ids):
    r = http.post("/v1/embeddings", json={"input": given, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "fake-model"
    assert [d["object"] for d in body["data"]] == ["embedding"] * len(ids)
    assert [d["embedding"] for d in body["data"]] == [_want(i) for i in ids]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                             "total_tokens": sum(map(len, ids))}


def test_base64_is_little_endian_float32(http):
    r = http.post("/v1/embeddings", json={"input": "Hi", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == \
        np.asarray(_want(_ids("Hi")), dtype=np.float32).tolist()


def test_pooling_option(start_server):
    srv, _ = start_server(pooling="last")
    with httpx.Client(base_url=srv.url) as http:
        got = http.post("/v1/embeddings", json={"input": "Hi"}).json()["data"][0]["embedding"]
    assert got == _want(_ids("Hi"), "last")


def test_a_text_may_fill_the_context(start_server):
    srv, engine = start_server(FakeEngine(n_ctx=8))
    with httpx.Client(base_url=srv.url) as http:
        assert http.post("/v1/embeddings", json={"input": list(range(3, 11))}).status_code == 200
        assert_error(http.post("/v1/embeddings", json={"input": [[3, 4], list(range(3, 12))]}),
                     400, param="input", code="context_length_exceeded")
        err = assert_error(http.post("/v1/embeddings", json={"input": "x" * 20}), 400,
                           param="input", code="context_length_exceeded")
        assert "maximum context length is 8 tokens but the input has 21 tokens" in \
            err["message"]


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "non-empty"),
    ({"input": []}, "input", "non-empty"),
    ({"input": ["a", ""]}, "input", "input[1]: expected a non-empty"),
    ({"input": [[3], []]}, "input", "input[1]"),
    ({"input": ["a"] * 257}, "input", "257 texts is more than 256"),
    ({"input": [3, 9999]}, "input", "token id 9999 is outside the vocabulary"),
    ({"input": "a", "dimensions": 2}, "dimensions", "not supported"),
    ({"input": "a", "encoding_format": "fp16"}, "encoding_format", ""),
    ({"input": 3}, "input", ""),
    ({"input": "a", "truncate": True}, "truncate", ""),
])
def test_bad_requests(http, body, param, says):
    err = assert_error(http.post("/v1/embeddings", json=body), 400, param=param)
    assert says in err["message"]


def test_unknown_model(http):
    assert_error(http.post("/v1/embeddings", json={"input": "a", "model": "other"}), 404,
                 param="model", code="model_not_found")


def test_an_engine_without_embeddings(start_server):
    class NoEmbed(FakeEngine):
        embed = None

    srv, _ = start_server(NoEmbed())
    with httpx.Client(base_url=srv.url) as http:
        err = assert_error(http.post("/v1/embeddings", json={"input": "a"}), 400, param="input")
    assert "does not compute embeddings" in err["message"]


def test_pooling_is_checked(fake_server):
    from sparseinfer.server.app import create_app

    with pytest.raises(ValueError, match=r"pooling: expected one of \['last', 'mean'\], got 'cls'"):
        create_app(FakeEngine(), pooling="cls")


def test_openapi_declares_the_route(http):
    spec = http.get("/openapi.json").json()
    assert "/v1/embeddings" in spec["paths"]
