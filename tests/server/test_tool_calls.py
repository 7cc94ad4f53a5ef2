"""Several tool calls in one answer (OpenAI ``parallel_tool_calls``), over a fake engine with a
byte-level vocabulary (so the tool grammar compiles): the answer's calls come back in
``message.tool_calls`` with distinct ids, streamed one chunk per call; the grammar the request
compiled allows a JSON array of calls unless ``parallel_tool_calls`` is false or ``tool_choice``
names a tool. The fake's words are scripted (``[[say:...]]``), its processors recorded."""

from __future__ import annotations

import json

import httpx
import pytest

from sparseinfer.server.structured import GrammarProcessor

from .fake_engine import EOS, OFFSET, FakeEngine
from .helpers import openai_client


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ``ByteLevel`` alphabet, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


class ToolFake(FakeEngine):
    """The fake engine with its byte vocabulary (id = byte + 3) as a ``tokenizers`` JSON."""

    eos_ids = frozenset({EOS})

    def tokenizer_json(self) -> str:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({ch: b + OFFSET for b, ch in _bytes_to_unicode().items()})
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok.to_str()


def _tool(name: str, prop: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} somewhere",
        "parameters": {"type": "object", "properties": {prop: {"type": "string"}},
                       "required": [prop], "additionalProperties": False}}}


TOOLS = [_tool("get_weather", "city"), _tool("get_time", "zone")]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
TWO = f"[{WEATHER}, {TIME}]"  # the grammar's own spacing (", " and ": ")


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": f"[[say:{text} ]]"}]  # the space: "]" then "]]"


@pytest.fixture(scope="module")
def tool_server():
    from sparseinfer.server.app import ServerThread, create_app

    engine = ToolFake(n_ctx=4096)
    with ServerThread(create_app(engine)) as srv:
        yield srv, engine


def _grammar_accepts(engine: ToolFake, text: str) -> bool:
    """Whether the grammar of the engine's last request accepts ``text`` then end-of-text."""
    [proc] = [p for p in engine.processors[-1] if isinstance(p, GrammarProcessor)]
    proc.matcher.reset()
    return proc.matcher.accept_string(text) and proc.matcher.accept_token(EOS)


@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_several_calls_in_one_answer(tool_server, choice):
    srv, engine = tool_server
    kw = {} if choice is None else {"tool_choice": choice}
    r = openai_client(srv).chat.completions.create(
        model=engine.name, messages=_ask(TWO), tools=TOOLS, max_tokens=50, **kw)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    calls = choice0.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"},
                                                                  {"zone": "CET"}]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    assert _grammar_accepts(engine, TWO)
    assert _grammar_accepts(engine, WEATHER)  # one call may still be a lone object
    assert "JSON array" in engine.started[-1]  # the prompt says how to call several


def test_one_call_is_still_one(tool_server):
    srv, engine = tool_server
    r = openai_client(srv).chat.completions.create(
        model=engine.name, messages=_ask(f"[{WEATHER}]"), tools=TOOLS, max_tokens=50)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"


@pytest.mark.parametrize("kw", [
    {"parallel_tool_calls": False},
    {"parallel_tool_calls": False, "tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
])
def test_exactly_one_call_when_parallel_is_off_or_a_tool_is_named(tool_server, kw):
    srv, engine = tool_server
    r = openai_client(srv).chat.completions.create(
        model=engine.name, messages=_ask(WEATHER), tools=TOOLS, max_tokens=50, **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert _grammar_accepts(engine, WEATHER)
    if "tool_choice" in kw:  # (auto lets any text through, one starting with "[" too)
        assert not _grammar_accepts(engine, TWO)
        assert not _grammar_accepts(engine, f"[{WEATHER}]")
    assert "JSON array" not in engine.started[-1]


def test_auto_text_cannot_start_like_calls(tool_server):
    srv, engine = tool_server
    r = openai_client(srv).chat.completions.create(
        model=engine.name, messages=_ask("Hello there"), tools=TOOLS, max_tokens=50)
    assert r.choices[0].message.content == "Hello there"
    assert r.choices[0].message.tool_calls is None
    assert _grammar_accepts(engine, "Hello there")
    assert not _grammar_accepts(engine, "[1, 2]")


def test_streamed_one_chunk_per_call(tool_server):
    srv, engine = tool_server
    client = openai_client(srv)
    chunks = list(client.chat.completions.create(
        model=engine.name, messages=_ask(TWO), tools=TOOLS, max_tokens=50, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0, 1]
    assert [d.function.name for d in deltas] == ["get_weather", "get_time"]
    assert [json.loads(d.function.arguments) for d in deltas] == [{"city": "Paris"},
                                                                   {"zone": "CET"}]
    assert all(d.id and d.type == "function" for d in deltas)
    assert deltas[0].id != deltas[1].id
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # on the wire: each call's function name comes before its arguments
    with httpx.stream("POST", srv.base_url + "/chat/completions", timeout=30, json={
            "messages": _ask(TWO), "tools": TOOLS, "max_tokens": 50, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if '"tool_calls":[{' in ln]
    assert len(lines) == 2
    assert all(ln.index('"name"') < ln.index('"arguments"') for ln in lines)
    # the openai client's own accumulation of the stream
    with client.chat.completions.stream(model=engine.name, messages=_ask(TWO), tools=TOOLS,
                                        max_tokens=50) as stream:
        final = stream.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == [
        "get_weather", "get_time"]


def test_several_calls_go_back_to_the_model_as_an_array(tool_server):
    srv, engine = tool_server
    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": n, "arguments": a}} for i, (n, a) in
        enumerate([("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')])]
    openai_client(srv).chat.completions.create(
        model=engine.name, tools=TOOLS, max_tokens=3, messages=[
            {"role": "user", "content": "weather and time?"},
            {"role": "assistant", "tool_calls": calls},
            {"role": "user", "content": "thanks"}])
    assert TWO in engine.started[-1]


@pytest.mark.slow
def test_langchain_bind_tools_gets_several_calls(tool_server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    srv, engine = tool_server

    class get_weather(BaseModel):  # noqa: N801 (the tool's name)
        """The weather somewhere."""

        city: str

    class get_time(BaseModel):  # noqa: N801
        """The time somewhere."""

        zone: str

    llm = ChatOpenAI(model=engine.name, base_url=srv.base_url, api_key="none", max_tokens=50,
                     max_retries=0, timeout=30)
    msg = llm.bind_tools([get_weather, get_time]).invoke(_ask(TWO)[0]["content"])
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c["id"] for c in msg.tool_calls}) == 2


def test_an_array_is_text_when_parallel_is_off(tool_server):
    """With ``parallel_tool_calls: false`` an auto answer that happens to be an array of calls
    is text (the grammar let it through as text), never several calls."""
    srv, engine = tool_server
    r = openai_client(srv).chat.completions.create(
        model=engine.name, messages=_ask(TWO), tools=TOOLS, max_tokens=50,
        parallel_tool_calls=False)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == TWO
