"""Ollama's own API (``/api/*``) through Ollama's official Python client (``ollama`` on PyPI,
the independent reference for the wire format) and raw NDJSON: over the fake engine for every
route, option and error; over the real SmolLM2 for answers equal to the OpenAI routes'."""

from __future__ import annotations

import json

import httpx
import pytest

from sparseinfer.config import SamplingParams

from .fake_engine import BOS, OFFSET, FakeEngine

ollama = pytest.importorskip("ollama")

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def oc(fake_server):
    return ollama.Client(host=fake_server[0].url)


def test_tags_ps_show_version(oc, fake_server):
    srv, engine = fake_server
    assert [m.model for m in oc.list().models] == ["fake-model:latest"]
    assert [m.model for m in oc.ps().models] == ["fake-model:latest"]
    shown = oc.show("fake-model")
    assert "completion" in shown.capabilities and "embedding" in shown.capabilities
    assert httpx.get(srv.url + "/api/version").json()["version"]


def test_chat_whole_and_streamed(oc, fake_server):
    engine = fake_server[1]
    r = oc.chat(model="fake-model", messages=USER, options={"num_predict": 3})
    assert r.message.role == "assistant" and r.message.content == "one two three"
    assert r.done and r.done_reason == "length" and r.eval_count == 3
    assert r.prompt_eval_count == len(engine.chat_prompt(USER))
    parts = list(oc.chat(model="fake-model:latest", messages=USER, options={"num_predict": 3},
                         stream=True))
    assert "".join(p.message.content for p in parts) == "one two three"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 3
    said = oc.chat(model="fake-model", messages=[{"role": "user", "content": "[[say:a b]]"}])
    assert said.message.content == "a b" and said.done_reason == "stop"


def test_ndjson_wire_format(fake_server):
    """Streamed by default, one JSON object a line, the last with the counts and durations."""
    srv = fake_server[0]
    with httpx.stream("POST", srv.url + "/api/generate", json={
            "model": "fake-model", "prompt": "x", "options": {"num_predict": 2}}) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [ln["response"] for ln in lines[:-1]] == ["one", " two"]
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] == "length"
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                "eval_count", "eval_duration", "context", "created_at", "model"):
        assert key in last, key


def test_options_map_onto_sampling(oc, fake_server):
    engine = fake_server[1]
    oc.generate(model="fake-model", prompt="x", options={
        "temperature": 0.3, "top_k": 7.0, "top_p": 0.5, "min_p": 0.1, "seed": 42,
        "num_predict": 4, "stop": ["zz"], "repeat_penalty": 1.2, "repeat_last_n": 16,
        "num_ctx": 4096, "num_thread": 2, "mirostat": 0})  # the last three: ignored
    assert engine.params[-1] == SamplingParams(
        max_tokens=4, temperature=0.3, top_k=7, top_p=0.5, min_p=0.1, seed=42, stop=("zz",),
        repeat_penalty=1.2, repeat_last_n=16)
    oc.generate(model="fake-model", prompt="x", options={"num_predict": -2})
    assert engine.params[-1].max_tokens > 0  # the room the context leaves (server clamps -1)


def test_num_predict_against_the_servers_budget(start_server):
    """Unset: the server's default budget; -1 / -2 (no bound): the server's limit, if any."""
    srv, engine = start_server(default_max_tokens=5, max_tokens_limit=50)
    oc = ollama.Client(host=srv.url)
    for options, want in (({}, 5), ({"num_predict": -1}, 50), ({"num_predict": 7}, 7)):
        oc.generate(model="fake-model", prompt="x", options=options)
        assert engine.params[-1].max_tokens == want, options
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model="fake-model", prompt="x", options={"num_predict": 51})
    assert e.value.status_code == 400 and "at most 50 tokens" in e.value.error


def test_generate_templates_unless_raw_and_continues_a_context(oc, fake_server):
    engine = fake_server[1]
    r = oc.generate(model="fake-model", prompt="hello", system="be brief",
                    options={"num_predict": 1})
    want = engine.chat_prompt([{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hello"}])
    assert engine.started[-1] == engine.decode(want)
    assert r.context[: len(want)] == want and len(r.context) == len(want) + 1
    oc.generate(model="fake-model", prompt="hello", raw=True, options={"num_predict": 1})
    assert engine.started[-1] == "hello"
    oc.generate(model="fake-model", prompt="again", context=want, raw=True,
                options={"num_predict": 1})
    assert engine.started[-1] == engine.decode(want + [BOS] + [b + OFFSET for b in b"again"])


def test_tool_calls_come_back_with_object_arguments():
    """How /api/chat spells an answer of tool calls (the text the grammar let through), and a
    plain answer when the model chose to call none."""
    from sparseinfer.engine import TokenEvent
    from sparseinfer.server.ollama import _ChatShape

    shape = _ChatShape(("get_weather",))
    for piece in ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}, ',
                  '{"name": "get_weather", "arguments": {"city": "Rome"}}]']:
        assert shape.token(TokenEvent(5, piece)) is None  # held back: sent whole at the end
    [line] = shape.end()
    calls = [{"function": {"name": "get_weather", "arguments": {"city": c}}}
             for c in ("Paris", "Rome")]
    assert line == {"message": {"role": "assistant", "content": "", "tool_calls": calls}}
    whole = shape.whole({"done": True})
    assert whole["message"] == {"role": "assistant", "content": "", "tool_calls": calls}
    # what Ollama's client makes of it
    assert [dict(c.function.arguments) for c in ollama.ChatResponse(**whole).message.tool_calls] \
        == [{"city": "Paris"}, {"city": "Rome"}]
    plain = _ChatShape(("get_weather",))
    plain.token(TokenEvent(5, "It is sunny."))
    assert plain.end() == [{"message": {"role": "assistant", "content": "It is sunny."}}]
    assert plain.whole({})["message"] == {"role": "assistant", "content": "It is sunny."}


def test_embed_and_the_older_embeddings(oc):
    r = oc.embed(model="fake-model", input=["a", "bb"])
    assert len(r.embeddings) == 2 and r.prompt_eval_count == 2 + 3
    for v in r.embeddings:
        assert abs(sum(x * x for x in v) - 1) < 1e-9
    assert oc.embeddings(model="fake-model", prompt="a").embedding == r.embeddings[0]


def test_embed_truncates_unless_asked_not_to(start_server):
    srv, _ = start_server(FakeEngine(n_ctx=4))
    oc = ollama.Client(host=srv.url)
    assert oc.embed(model="fake-model", input="abcdefgh").prompt_eval_count == 4
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model="fake-model", input="abcdefgh", truncate=False)
    assert e.value.status_code == 400 and "more than the context length 4" in e.value.error


def test_an_empty_prompt_only_loads(oc):
    r = oc.generate(model="fake-model", prompt="")
    assert r.done and r.done_reason == "load"
    assert oc.chat(model="fake-model", messages=[]).done_reason == "load"


@pytest.mark.parametrize("path, body, status, says", [
    ("/api/chat", {"model": "other", "messages": USER}, 404, "model 'other' not found"),
    ("/api/chat", {"messages": USER}, 400, "model is required"),
    ("/api/chat", {"model": "fake-model", "messages": USER, "think": True}, 400, "think"),
    ("/api/chat", {"model": "fake-model", "messages": [
        {"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "robot", "content": "x"}]},
     400, "role"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/api/generate", {"model": "fake-model", "prompt": "x",
                       "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "options": {"num_predict": -3}},
     400, "options.num_predict"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "options": {"top_k": 4.5}},
     400, "options.top_k: expected an integer"),
    ("/api/embed", {"model": "fake-model", "input": ""}, 400, "input"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
])
def test_errors_are_ollamas(fake_server, path, body, status, says):
    r = httpx.post(fake_server[0].url + path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and says in r.json()["error"]


def test_ollama_client_error(oc):
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="llama3", messages=USER)
    assert e.value.status_code == 404 and "llama3" in e.value.error


# -- the real model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_chat_and_generate_equal_the_engines_greedy_answer(real_engine_server):
    from .conftest import REAL_MSGS, REAL_N

    srv, engine, ids, text, finish = real_engine_server
    engine.forget_prefix()
    oc = ollama.Client(host=srv.url, timeout=120)
    opts = {"temperature": 0, "num_predict": REAL_N}
    r = oc.chat(model=engine.name, messages=REAL_MSGS, options=opts)
    assert r.message.content == text and r.prompt_eval_count == len(ids)
    assert r.eval_count == finish.completion_tokens
    streamed = "".join(p.message.content for p in oc.chat(
        model=engine.name, messages=REAL_MSGS, options=opts, stream=True))
    assert streamed == text
    [turn] = REAL_MSGS  # one user turn: /api/generate templates its prompt into the same ids
    g = oc.generate(model=engine.name, prompt=turn["content"], options=opts)
    assert g.response == text and g.context[: g.prompt_eval_count] == ids
    assert len(g.context) == len(ids) + g.eval_count
    v = oc.embed(model=engine.name, input="Paris").embeddings[0]
    assert v == pytest.approx(engine.embed(engine.encode("Paris")), abs=1e-6)


@pytest.mark.slow
def test_real_format_and_tools(real_engine_server):
    """``format`` (a schema, "json") constrains the answer; with ``tools`` the answer is either
    calls of the named tool with valid arguments or plain text (the model chooses: Ollama has
    no tool_choice)."""
    srv, engine, *_ = real_engine_server
    oc = ollama.Client(host=srv.url, timeout=120)
    city = {"type": "object", "properties": {"city": {"type": "string",
                                                      "enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}
    r = oc.chat(model=engine.name, messages=[{"role": "user", "content": "Name a city, as JSON."}],
                format=city, options={"temperature": 0, "num_predict": 30})
    assert json.loads(r.message.content)["city"] in ("Paris", "Rome") and r.done_reason == "stop"
    g = oc.generate(model=engine.name, prompt="Give me an empty JSON object", format="json",
                    options={"temperature": 0, "num_predict": 30})
    assert g.response.startswith("{")
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    r = oc.chat(model=engine.name, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[weather], options={"temperature": 0, "num_predict": 30})
    if r.message.tool_calls:
        assert {c.function.name for c in r.message.tool_calls} == {"get_weather"}
        assert all("city" in c.function.arguments for c in r.message.tool_calls)
    else:
        assert r.message.content and not r.message.content.lstrip().startswith(("{", "["))
