"""Schema fuzzing: schemathesis generates requests from our own /openapi.json (valid and invalid
bodies) against the real server on 127.0.0.1 over the fake engine; no answer may be a 5xx, use an
undeclared status code or content type, or break its declared schema. Bounded: a fixed number of
examples per operation, no shrinking database, the fake engine's small context."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from sparseinfer.server.app import ServerThread, create_app  # noqa: E402

from .fake_engine import FakeEngine  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 40  # per operation


@pytest.fixture(scope="module")
def fuzz_server():
    # small context and a token limit keep each generated request to a few ms
    engine = FakeEngine(n_ctx=128)
    with ServerThread(create_app(engine, max_tokens_limit=64)) as srv:
        yield srv


def _operations(srv):
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz(fuzz_server, mode):
    ops = _operations(fuzz_server)
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions",
                                       "/v1/embeddings", "/health"}
    for op in ops:
        if mode == "negative" and op.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        def check(case) -> None:
            response = case.call(base_url=fuzz_server.url, timeout=10)
            case.validate_response(response, checks=CHECKS)

        check()
