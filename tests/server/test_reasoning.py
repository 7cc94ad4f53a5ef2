"""A thinking model's thoughts apart from its answer, on both APIs: ``reasoning_content`` (the
OpenAI routes, as llama.cpp's server returns it) read through the official client, and
Ollama's ``thinking`` through Ollama's client; over the fake engine as a thinking model whose
answers are spelled a character a token, so tags arrive cut in pieces. The expected split is
``tests/test_reasoning.py``'s regular expressions over the whole text."""

from __future__ import annotations

import json

import httpx
import pytest

from .fake_engine import FakeEngine
from .helpers import assert_error, openai_client
from .test_tool_calls import ToolFake

THOUGHTFUL = "<think>\nCount: 2 + 2.\nThat is 4.\n</think>\n\nIt is 4."
THOUGHT, ANSWER = "Count: 2 + 2.\nThat is 4.", "It is 4."


def spell(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[[spell:{text}]]"}]


@pytest.fixture
def thinking(start_server):
    srv, engine = start_server(FakeEngine(think=True))
    return srv, engine, openai_client(srv)


def test_whole_answer_has_reasoning_content(thinking):
    _, engine, client = thinking
    r = client.chat.completions.create(model="fake-model", messages=spell(THOUGHTFUL))
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(THOUGHTFUL)  # every token counted, thoughts too
    assert engine.template_kwargs == [None]


def test_streamed_thoughts_come_as_reasoning_deltas(thinking):
    _, _, client = thinking
    chunks = list(client.chat.completions.create(model="fake-model", messages=spell(THOUGHTFUL),
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    content = [d.content for d in deltas]
    assert "".join(r for r in reasoning if r) == THOUGHT
    assert "".join(c for c in content if c) == ANSWER
    # streamed as they come: several reasoning deltas, all before the first answer text
    said = [i for i, r in enumerate(reasoning) if r]
    first_answer = next(i for i, c in enumerate(content) if c)
    assert len(said) > 5 and max(said) < first_answer
    # a delta carries one or the other, never an empty reasoning_content key
    assert all(not (r and c) for r, c in zip(reasoning, content))
    assert all("reasoning_content" not in (d.model_extra or {}) or d.model_extra[
        "reasoning_content"] for d in deltas)


def test_open_thought_in_the_prompt(start_server):
    """DeepSeek-R1's template opens the thought: the model only closes it."""
    srv, _ = start_server(FakeEngine(think="open"))
    r = openai_client(srv).chat.completions.create(
        model="fake-model", messages=spell("Hmm.\n</think>\nYes."))
    assert r.choices[0].message.content == "Yes."
    assert r.choices[0].message.model_extra["reasoning_content"] == "Hmm."
    again = openai_client(srv).chat.completions.create(  # the model opening it once more
        model="fake-model", messages=spell("<think>Hmm.</think>Yes."))
    assert again.choices[0].message.model_extra["reasoning_content"] == "Hmm."
    assert again.choices[0].message.content == "Yes."
    cut = openai_client(srv).chat.completions.create(
        model="fake-model", messages=spell("still thinking"), max_tokens=5)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content == ""
    assert cut.choices[0].message.model_extra["reasoning_content"] == "still"


def test_reasoning_format_none_and_template_kwargs(thinking, start_server):
    srv, engine, client = thinking
    raw = client.chat.completions.create(model="fake-model", messages=spell(THOUGHTFUL),
                                         extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == THOUGHTFUL
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    off = client.chat.completions.create(
        model="fake-model", messages=spell("4."),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "4."
    assert engine.template_kwargs[-1] == {"enable_thinking": False}
    assert engine.started[-1].endswith("<|assistant|><think>\n\n</think>\n\n")
    r = httpx.post(srv.base_url + "/chat/completions", json={
        "messages": spell("x"), "chat_template_kwargs": {"messages": []}})
    assert_error(r, 400, param="chat_template_kwargs")
    r = httpx.post(srv.base_url + "/chat/completions", json={
        "messages": spell("x"), "reasoning_format": "maybe"})
    assert_error(r, 400, param="reasoning_format")
    # the server's own settings: thoughts left in, and variables for every request
    srv2, engine2 = start_server(FakeEngine(think=True), reasoning_format="none",
                                 chat_template_kwargs={"enable_thinking": False, "x": 1})
    c2 = openai_client(srv2)
    assert c2.chat.completions.create(
        model="fake-model", messages=spell(THOUGHTFUL)).choices[0].message.content == THOUGHTFUL
    c2.chat.completions.create(model="fake-model", messages=spell("a"),
                               extra_body={"chat_template_kwargs": {"x": 2}})
    assert engine2.template_kwargs[-1] == {"enable_thinking": False, "x": 2}
    with pytest.raises(ValueError, match="reasoning_format"):
        start_server(FakeEngine(), reasoning_format="sometimes")


def test_a_model_that_does_not_think(start_server):
    """No think tags: the text is the answer, <think> or not, and no reasoning_content key."""
    srv, _ = start_server(FakeEngine())
    r = httpx.post(srv.base_url + "/chat/completions", json={"messages": spell(THOUGHTFUL)})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == THOUGHTFUL and "reasoning_content" not in message


def test_constrained_answers_are_not_split(start_server):
    """A JSON answer or tool calls start at the first token: the thoughts' splitter stays out
    (the fake's scripted words stand for what the grammar would allow)."""
    srv, _ = start_server(ToolFake(think=True))
    r = openai_client(srv).chat.completions.create(
        model="fake-model", messages=spell("<think>a</think>{}"),
        response_format={"type": "json_object"})
    assert r.choices[0].message.content == "<think>a</think>{}"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_earlier_thoughts_sent_back_are_accepted(thinking):
    """A client sending the last answer back with its reasoning_content (as it got it) is not
    refused; the thoughts are not shown to the model again."""
    _, engine, client = thinking
    client.chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        *spell("a")])
    assert "greet back" not in engine.started[-1]


# -- Ollama's API -------------------------------------------------------------------------------

ollama = pytest.importorskip("ollama")


def test_ollama_chat_and_generate_thinking(thinking):
    srv, engine, _ = thinking
    oc = ollama.Client(host=srv.url)
    r = oc.chat(model="fake-model", messages=spell(THOUGHTFUL))
    assert r.message.content == ANSWER and r.message.thinking == THOUGHT
    parts = list(oc.chat(model="fake-model", messages=spell(THOUGHTFUL), stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER
    g = oc.generate(model="fake-model", prompt=f"[[spell:{THOUGHTFUL}]]")
    assert g.response == ANSWER and g.thinking == THOUGHT
    streamed = list(oc.generate(model="fake-model", prompt=f"[[spell:{THOUGHTFUL}]]",
                                stream=True))
    assert "".join(p.thinking or "" for p in streamed) == THOUGHT
    assert "".join(p.response for p in streamed) == ANSWER
    raw = oc.generate(model="fake-model", prompt=f"[[spell:{THOUGHTFUL}]]", raw=True)
    assert raw.response == THOUGHTFUL and not raw.thinking
    assert "thinking" in oc.show("fake-model").capabilities


def test_ollama_think_switch(thinking, start_server):
    srv, engine, _ = thinking
    oc = ollama.Client(host=srv.url)
    oc.chat(model="fake-model", messages=spell("a"), think=False)
    assert engine.template_kwargs[-1] == {"enable_thinking": False}
    oc.generate(model="fake-model", prompt="[[spell:a]]", think=True)
    assert engine.template_kwargs[-1] == {"enable_thinking": True}
    oc.chat(model="fake-model", messages=spell("a"))
    assert engine.template_kwargs[-1] is None  # unset: the model's default
    r = httpx.post(srv.url + "/api/chat", json={"model": "fake-model", "messages": spell("a"),
                                                "think": "high", "stream": False})
    assert r.status_code == 400 and "think" in r.json()["error"]
    plain_srv, plain = start_server(FakeEngine())
    r = httpx.post(plain_srv.url + "/api/chat", json={
        "model": "fake-model", "messages": spell("a"), "think": True, "stream": False})
    assert r.status_code == 400 and "does not support thinking" in r.json()["error"]
    r = httpx.post(plain_srv.url + "/api/chat", json={
        "model": "fake-model", "messages": spell("a"), "think": False, "stream": False})
    assert r.status_code == 200 and plain.template_kwargs[-1] is None
    assert "thinking" not in json.dumps(httpx.post(plain_srv.url + "/api/show", json={
        "model": "fake-model"}).json()["capabilities"])
