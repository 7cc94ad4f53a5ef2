"""OpenAI's Responses API (``/v1/responses``) through the official Python client — its typed
responses, its stream events and its stream accumulator (``client.responses.stream``) are the
reference for the wire format — over the fake engine (scripted answers), a fake thinking model
and the tool fake with a byte vocabulary; the real SmolLM2 answers as on the chat route."""

from __future__ import annotations

import json

import httpx
import pytest

from .fake_engine import FakeEngine
from .helpers import assert_error, event_classes, openai_client, streamed_events
from .test_tool_calls import ToolFake

THOUGHTFUL = "<think>\nCount: 2 + 2.\n</think>\n\nIt is 4."


def test_a_string_input_answers(client, fake_server):
    engine = fake_server[1]
    r = client.responses.create(model="fake-model", input="[[say:Hello there]]",
                                instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Hello there"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed"
    assert r.usage.output_tokens == 2 and r.usage.input_tokens == len(engine.encode(
        engine.started[-1])) and r.usage.total_tokens == r.usage.input_tokens + 2
    assert engine.started[-1] == ("<|system|>Be brief.\n<|user|>[[say:Hello there]]\n"
                                  "<|assistant|>")
    assert engine.params[-1].max_tokens == 8 and engine.params[-1].temperature == 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 8


def test_items_and_output_sent_back(client, fake_server):
    """A conversation as items, and an answer's output appended as the client got it."""
    engine = fake_server[1]
    first = client.responses.create(model="fake-model", input=[
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                          "text": "[[say:one]]"}]}])
    assert first.output_text == "one"
    again = client.responses.create(model="fake-model", input=[
        {"role": "user", "content": "first"}, *first.output,
        {"role": "user", "content": "and [[say:two]]"}])
    assert again.output_text == "two"
    assert engine.started[-1] == ("<|user|>first\n<|assistant|>one\n"
                                  "<|user|>and [[say:two]]\n<|assistant|>")
    assert engine.started[-2].startswith("<|system|>sys\n")


def test_incomplete_when_max_output_tokens_cuts(client):
    r = client.responses.create(model="fake-model", input="count", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "one two three" and r.output[0].status == "incomplete"


def test_stream_events_and_accumulated_response(client):
    events = list(client.responses.create(model="fake-model", input="[[say:a b c]]",
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "a b c"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kinds.count(kind) == 1, kind
    assert events[-1].response.output_text == "a b c"
    # the SDK's own accumulator rebuilds the same response from the events
    with client.responses.stream(model="fake-model", input="[[say:x y]]") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "x y" and final.output_text == "x y"
    assert final.status == "completed"


def test_thinking_model_reasoning_item(start_server):
    srv, engine = start_server(FakeEngine(think=True))
    client = openai_client(srv)
    r = client.responses.create(model="fake-model", input=f"[[spell:{THOUGHTFUL}]]")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "Count: 2 + 2."
    assert r.output_text == "It is 4."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(model="fake-model", input=f"[[spell:{THOUGHTFUL}]]") as stream:
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "Count: 2 + 2."
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "It is 4."
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    client.responses.create(model="fake-model", input="[[spell:a]]",
                            reasoning={"effort": "none"})
    assert engine.template_kwargs[-1] == {"enable_thinking": False}
    # the reasoning item sent back is accepted and not shown to the model
    client.responses.create(model="fake-model", input=[
        {"role": "user", "content": "q"}, *r.output, {"role": "user", "content": "[[say:ok]]"}])
    assert "Count" not in engine.started[-1]


class ToolRoleFake(ToolFake):
    """The tool fake whose template also takes tool results (role "tool")."""

    def chat_prompt(self, messages, template_kwargs=None):
        return super().chat_prompt([{**m, "role": "user" if m["role"] == "tool" else m["role"],
                                     "content": ("[tool] " if m["role"] == "tool" else "")
                                     + m["content"]} for m in messages], template_kwargs)


def test_function_tools_round_trip(start_server):
    srv, engine = start_server(ToolRoleFake(n_ctx=4096))
    client = openai_client(srv)
    tools = [{"type": "function", "name": "get_weather", "description": "weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    r = client.responses.create(model="fake-model", input=f"[[say:{call} ]]", tools=tools)
    [fc] = r.output
    assert fc.type == "function_call" and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id.startswith("call_")
    assert "get_weather" in engine.started[-1]  # the tools were prompted
    # streamed: the call's arguments as one delta and done
    events = list(client.responses.create(model="fake-model", input=f"[[say:{call} ]]",
                                          tools=tools, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert events[-1].response.output[0].type == "function_call"
    # the result goes back as a function_call_output item
    client.responses.create(model="fake-model", tools=tools, input=[
        {"role": "user", "content": "weather?"}, *r.output,
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"},
        {"role": "user", "content": "[[say:Sunny.]]"}])
    assert '<|assistant|>{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
        '<|user|>[tool] sunny\n' in engine.started[-1]
    # a JSON answer by schema
    r = client.responses.create(model="fake-model", input='[[say:{"a": 1} ]]', text={
        "format": {"type": "json_schema", "name": "a", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}})
    assert json.loads(r.output_text) == {"a": 1}


def test_every_event_and_response_validates_strictly(start_server):
    """Each streamed event, validated (not merely constructed, as the SDK does) against the
    SDK's model of its type, and each whole response against ``Response``: plain, cut short,
    thinking, tool calls."""
    from openai.types.responses import Response, ResponseStreamEvent

    classes = event_classes(ResponseStreamEvent)
    srv, _ = start_server(ToolRoleFake(n_ctx=4096, think=True))
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    bodies = [{"input": "[[say:a b]]"}, {"input": "count", "max_output_tokens": 2},
              {"input": f"[[spell:{THOUGHTFUL}]]"},
              {"input": '[[say:{"name": "f", "arguments": {}} ]]', "tools": tools}]
    seen = set()
    for body in bodies:
        whole = httpx.post(srv.base_url + "/responses", json=body, timeout=10).json()
        Response.model_validate(whole)
        data = streamed_events(srv.base_url + "/responses", body, classes)
        seen |= {d["type"] for d in data}
        Response.model_validate(data[-1]["response"])
    assert {"response.incomplete", "response.reasoning_text.delta",
            "response.function_call_arguments.done"} <= seen


def test_errors(fake_server):
    srv = fake_server[0]
    url = srv.base_url + "/responses"
    assert_error(httpx.post(url, json={"input": "x", "previous_response_id": "resp_1"}), 400,
                 param="previous_response_id")
    assert_error(httpx.post(url, json={"input": "x", "frobnicate": 1}), 400)
    assert_error(httpx.post(url, json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}), 400)
    assert_error(httpx.post(url, json={"input": "x", "tools": [{"type": "web_search"}]}), 400)
    assert_error(httpx.post(url, json={"input": "x", "model": "other"}), 404, param="model")
    assert_error(httpx.post(url, json={"input": []}), 400, param="input")
    assert_error(httpx.post(url, json={"input": "x", "max_output_tokens": 0}), 400)
    r = httpx.post(url, json={"input": "[[say:ok]]", "store": True, "metadata": {"k": "v"}})
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"}


@pytest.mark.slow
def test_real_model_answers_as_the_chat_route(real_engine_server):
    from .conftest import REAL_MSGS, REAL_N

    srv, _, _, text, finish = real_engine_server
    client = openai_client(srv, timeout=60.0)
    r = client.responses.create(model=client.models.list().data[0].id,
                                input=REAL_MSGS[0]["content"], max_output_tokens=REAL_N,
                                temperature=0)
    assert r.output_text == text
    assert r.usage.input_tokens == finish.prompt_tokens
