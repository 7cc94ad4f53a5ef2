"""Anthropic's Messages API (``/v1/messages``) through Anthropic's official Python client — its
typed messages, its stream events and its stream helper's accumulated message are the reference
for the wire format — over the fake engine (scripted answers), a fake thinking model and the
tool fake with a byte vocabulary; the real SmolLM2 answers as on the chat route."""

from __future__ import annotations

import json

import httpx
import pytest

from .fake_engine import FakeEngine
from .helpers import event_classes, streamed_events
from .test_responses import THOUGHTFUL, ToolRoleFake

anthropic = pytest.importorskip("anthropic")


def client_of(srv, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    kw.setdefault("timeout", 10.0)
    return anthropic.Anthropic(base_url=srv.url, max_retries=0, **kw)


@pytest.fixture
def ac(fake_server):
    return client_of(fake_server[0])


def test_message_whole(ac, fake_server):
    engine = fake_server[1]
    m = ac.messages.create(model="fake-model", max_tokens=8, system="Be brief.", messages=[
        {"role": "user", "content": "[[say:Hello there]]"}], extra_body={"temperature": 0,
                                                                   "top_k": 5})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello there"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == 2
    assert m.usage.input_tokens == len(engine.encode(engine.started[-1]))
    assert engine.started[-1] == "<|system|>Be brief.\n<|user|>[[say:Hello there]]\n<|assistant|>"
    assert engine.params[-1].temperature == 0 and engine.params[-1].top_k == 5


def test_stop_reasons(ac):
    cut = ac.messages.create(model="fake-model", max_tokens=3,
                             messages=[{"role": "user", "content": "count"}])
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "one two three"
    stopped = ac.messages.create(model="fake-model", max_tokens=20, stop_sequences=["xx", "four"],
                                 messages=[{"role": "user", "content": "count"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "four"
    assert stopped.content[0].text == "one two three "


def test_stream_events_and_the_helpers_message(ac, fake_server):
    engine = fake_server[1]
    events = list(ac.messages.create(model="fake-model", max_tokens=20, stream=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "[[say:a b c]]",
                                      "cache_control": {"type": "ephemeral"}}]}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "a b c"
    assert events[0].message.usage.input_tokens == len(engine.encode(engine.started[-1]))
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == 3
    with ac.messages.stream(model="fake-model", max_tokens=20,
                            messages=[{"role": "user", "content": "[[say:x y]]"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "x y" and final.content[0].text == "x y" and final.stop_reason == "end_turn"


def test_thinking_blocks(start_server):
    srv, engine = start_server(FakeEngine(think=True))
    ac = client_of(srv)
    m = ac.messages.create(model="fake-model", max_tokens=100,
                           messages=[{"role": "user", "content": f"[[spell:{THOUGHTFUL}]]"}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Count: 2 + 2." and m.content[0].signature == ""
    assert m.content[1].text == "It is 4."
    with ac.messages.stream(model="fake-model", max_tokens=100, messages=[
            {"role": "user", "content": f"[[spell:{THOUGHTFUL}]]"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Count: 2 + 2." and final.content[1].text == "It is 4."
    assert any(e.type == "thinking" for e in events)
    ac.messages.create(model="fake-model", max_tokens=5, thinking={"type": "disabled"},
                       messages=[{"role": "user", "content": "[[spell:a]]"}])
    assert engine.template_kwargs[-1] == {"enable_thinking": False}
    # thoughts sent back are accepted and not shown to the model again
    ac.messages.create(model="fake-model", max_tokens=5, messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "[[say:ok]]"}])
    assert "Count" not in engine.started[-1] and "<|assistant|>It is 4.\n" in engine.started[-1]


TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_tool_use_round_trip(start_server):
    srv, engine = start_server(ToolRoleFake(n_ctx=4096))
    ac = client_of(srv)
    m = ac.messages.create(model="fake-model", max_tokens=100, tools=TOOLS,
                           messages=[{"role": "user", "content": f"[[say:{CALL} ]]"}])
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    assert m.stop_reason == "tool_use" and "get_weather" in engine.started[-1]
    with ac.messages.stream(model="fake-model", max_tokens=100, tools=TOOLS, messages=[
            {"role": "user", "content": f"[[say:{CALL} ]]"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    ac.messages.create(model="fake-model", max_tokens=100, tools=TOOLS, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny"}, {"type": "text",
                                                            "text": "[[say:Sunny.]]"}]}])
    assert ('<|assistant|>{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '<|user|>[tool] sunny\n<|user|>[[say:Sunny.]]') in engine.started[-1]
    plain = ac.messages.create(model="fake-model", max_tokens=100, tools=TOOLS,
                               messages=[{"role": "user", "content": "[[say:No need.]]"}])
    assert plain.content[0].text == "No need." and plain.stop_reason == "end_turn"
    js = ac.messages.create(model="fake-model", max_tokens=100, messages=[
        {"role": "user", "content": '[[say:{"a": 1} ]]'}], output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert json.loads(js.content[0].text) == {"a": 1}
    from sparseinfer.server.structured import GrammarProcessor

    assert any(isinstance(p, GrammarProcessor) for p in engine.processors[-1])


def test_count_tokens(ac, fake_server):
    engine = fake_server[1]
    messages = [{"role": "user", "content": "hello"}]
    n = ac.messages.count_tokens(model="fake-model", messages=messages, system="sys")
    assert n.input_tokens == len(engine.chat_prompt([{"role": "system", "content": "sys"},
                                                     *messages]))


def test_errors_are_anthropic_shaped(start_server, fake_server):
    url = fake_server[0].url + "/v1/messages"
    ok = {"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}

    def refused(body, status, at=url, **kw):
        r = httpx.post(at, json=body, **kw)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
        return err["error"]

    assert refused({**ok, "model": "claude-x"}, 404)["type"] == "not_found_error"
    assert refused({k: v for k, v in ok.items() if k != "max_tokens"}, 400)["type"] == \
        "invalid_request_error"
    assert "frob" in refused({**ok, "frob": 1}, 400)["message"]
    refused({**ok, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "x"}}]}]}, 400)
    refused({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400)
    with pytest.raises(anthropic.NotFoundError):
        client_of(fake_server[0]).messages.create(model="claude-x", max_tokens=5,
                                                  messages=[{"role": "user", "content": "x"}])
    # a server with a key: x-api-key (Anthropic's clients) or a bearer token
    srv, _ = start_server(api_key="sekret")
    keyed = srv.url + "/v1/messages"
    assert refused(ok, 401, keyed, headers={"x-api-key": "wrong"})["type"] == \
        "authentication_error"
    assert refused(ok, 401, keyed)["type"] == "authentication_error"
    good = client_of(srv, api_key="sekret").messages.create(
        model="fake-model", max_tokens=3, messages=[{"role": "user", "content": "[[say:in]]"}])
    assert good.content[0].text == "in"
    with pytest.raises(anthropic.AuthenticationError):
        client_of(srv, api_key="nope").messages.create(
            model="fake-model", max_tokens=3, messages=[{"role": "user", "content": "x"}])


@pytest.mark.slow
def test_real_model_answers_as_the_chat_route(real_engine_server):
    from .conftest import REAL_MSGS, REAL_N

    srv, engine, _, text, finish = real_engine_server
    m = client_of(srv, timeout=60.0).messages.create(
        model=engine.name, max_tokens=REAL_N, messages=REAL_MSGS, extra_body={"temperature": 0})
    assert m.content[0].text == text and m.usage.input_tokens == finish.prompt_tokens


def test_every_event_and_message_validates_strictly(start_server):
    """Each streamed event validated (not merely constructed, as the SDK does) against the
    SDK's model of its type, each whole answer against ``Message``: text, cut short, stopped,
    thinking, tool use."""
    from anthropic.types import Message, RawMessageStreamEvent

    classes = event_classes(RawMessageStreamEvent)
    srv, _ = start_server(ToolRoleFake(n_ctx=4096, think=True))
    url = srv.url + "/v1/messages"
    say = {"model": "fake-model", "max_tokens": 50}
    bodies = [{**say, "messages": [{"role": "user", "content": "[[say:a b]]"}]},
              {**say, "max_tokens": 2, "messages": [{"role": "user", "content": "count"}]},
              {**say, "stop_sequences": ["three"], "messages": [{"role": "user",
                                                                 "content": "count"}]},
              {**say, "messages": [{"role": "user", "content": f"[[spell:{THOUGHTFUL}]]"}]},
              {**say, "tools": TOOLS, "messages": [{"role": "user", "content":
                                                    f"[[say:{CALL} ]]"}]}]
    reasons = set()
    for body in bodies:
        reasons.add(Message.model_validate(httpx.post(url, json=body, timeout=10).json())
                    .stop_reason)
        streamed_events(url, body, classes)
    assert reasons == {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
