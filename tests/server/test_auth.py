"""With an API key, every /v1 route needs ``Authorization: Bearer <key>``; /health stays open."""

from __future__ import annotations

import httpx
import openai
import pytest

from .helpers import assert_error, openai_client

KEY = "sk-test-123"


@pytest.fixture
def keyed(start_server):
    srv, _ = start_server(api_key=KEY)
    return srv


def test_right_key(keyed):
    client = openai_client(keyed, api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert r.choices[0].message.content == "one"


def test_wrong_key(keyed):
    client = openai_client(keyed, api_key="sk-wrong")
    for call in (
        lambda: client.models.list(),
        lambda: client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}]
        ),
        lambda: client.completions.create(model="fake-model", prompt="x", stream=True),
    ):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"]
)
def test_missing_or_malformed_header(keyed, header):
    headers = {} if header is None else {"Authorization": header}
    r = httpx.post(keyed.base_url + "/completions", json={"prompt": "x"}, headers=headers)
    assert_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


def test_scheme_is_case_insensitive(keyed):
    r = httpx.get(keyed.base_url + "/models", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200


def test_auth_checked_before_body(keyed):
    """An unauthenticated client cannot make the server parse (or even read) a body."""
    r = httpx.post(keyed.base_url + "/chat/completions", content=b"{garbage")
    assert_error(r, 401)


def test_health_open(keyed):
    assert httpx.get(keyed.url + "/health").json()["status"] == "ok"
