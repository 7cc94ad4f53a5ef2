"""OpenAI's Responses API (``POST /v1/responses``) over the same engine and queue as the chat
route, for clients that speak it (the official SDKs' ``client.responses``, agent frameworks).

What is served (tested through the official Python client, its stream accumulator included):
- ``input``: a string, or items — messages (roles user / system / developer / assistant; text
  content, ``input_text`` / ``output_text`` parts), ``function_call`` and
  ``function_call_output`` items (a tool round trip), and earlier ``reasoning`` items (accepted,
  not shown to the model again, as thinking models' templates drop old thoughts). So a client
  may send back ``response.output`` as it got it. ``instructions`` becomes the system message.
- ``max_output_tokens``, ``temperature``, ``top_p``; ``text.format`` ``json_object`` /
  ``json_schema`` and function ``tools`` (``tool_choice`` auto / required / none / one named,
  ``parallel_tool_calls``) by the chat route's constrained decoding; ``reasoning.effort``
  "none" / "minimal" turns a thinking model's thinking off (``enable_thinking``).
- ``stream``: SSE events with ``sequence_number`` — ``response.created``,
  ``response.in_progress``, ``response.output_item.added`` / ``.done``,
  ``response.content_part.added`` / ``.done``, ``response.output_text.delta`` / ``.done``,
  ``response.reasoning_text.delta`` / ``.done`` (a thinking model's thoughts, as a
  ``reasoning`` output item), ``response.function_call_arguments.delta`` / ``.done``, and
  ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it).
- Nothing is stored: ``store`` is accepted and changes nothing, ``previous_response_id`` and
  ``conversation`` are 400s saying to send the conversation as ``input``. Images, files and
  hosted tools (web search, ...) are 400s naming the field; so is any other unknown field.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ..config import SamplingParams
from ..engine import FinishEvent, TokenEvent
from .protocol import APIError, FunctionDef, Tool

# -- requests --------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # on output_text parts sent back
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    """An input item's kind: its ``type``; a bare {"role", "content"} is a message."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class FormatText(_Strict):
    type: Literal["text"]


class FormatJSONObject(_Strict):
    type: Literal["json_object"]


class FormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: FormatText | FormatJSONObject | FormatJSONSchema | None = Field(
        None, discriminator="type")
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] | None = None


class ResponseRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    # accepted, change nothing: nothing is stored, no tier or cache to choose
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(None, max_length=0)
    # refused with a message saying what to do instead
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


# -- the route -------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesAPI:
    """``POST /v1/responses`` over an ``app.OpenAIServer`` (its queue, prompt building,
    grammars, limits and thought splitting)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def messages(self, req: ResponseRequest) -> list[dict[str, str]]:
        items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) \
            else req.input
        out = [{"role": "system", "content": req.instructions}] if req.instructions else []
        calls: list[str] = []  # one answer's calls, as the model spells them (grammar's shape)

        def answered() -> None:
            if calls:
                text = calls[0] if len(calls) == 1 else "[" + ", ".join(calls) + "]"
                out.append({"role": "assistant", "content": text})
                calls.clear()

        for item in items:
            if isinstance(item, FunctionCallItem):
                calls.append(f'{{"name": "{item.name}", "arguments": {item.arguments or "{}"}}}')
                continue
            answered()
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else "".join(
                    p.text for p in item.output)
                out.append({"role": "tool", "content": output})
        answered()
        if not any(m["role"] != "system" for m in out):
            raise APIError(400, "input: expected at least one message", param="input")
        return out

    async def create(self, request: Request) -> Response:
        from .app import _Call, _tool_prompt, with_system_text

        server = self.server
        req: ResponseRequest = await server.parse(request, ResponseRequest)
        if req.model is not None and req.model not in (server.model_name, server.engine.name):
            raise APIError(404, f"model: the model {req.model!r} does not exist; this server "
                           f"serves {server.model_name!r}", param="model", code="model_not_found")
        for field in ("previous_response_id", "conversation"):
            if getattr(req, field) is not None:
                raise APIError(400, f"{field}: this server stores no responses; send the whole "
                               "conversation as input", param=field)
        messages = self.messages(req)
        grammar, names, several = None, (), False
        fmt = req.text.format if req.text else None
        if req.tools and req.tool_choice != "none":
            named = req.tool_choice.name if isinstance(req.tool_choice, NamedFunction) else None
            if named is not None and named not in [t.name for t in req.tools]:
                raise APIError(400, f"tool_choice: no tool named {named!r}", param="tool_choice")
            if fmt is not None and fmt.type != "text":
                raise APIError(400, "text.format: cannot be combined with tools",
                               param="text.format")
            chosen = [t for t in req.tools if named is None or t.name == named]
            names = tuple(t.name for t in req.tools)
            several = named is None and req.parallel_tool_calls is not False
            mode = "auto" if req.tool_choice in (None, "auto") else "required"
            specs = [(t.name, t.parameters) for t in chosen]
            grammar = server._compile(lambda g: g.tool_calls(specs, mode, several), "tools")
            as_chat = [Tool(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters))
                for t in chosen]
            with_system_text(messages, _tool_prompt(as_chat, req.tool_choice if named is None
                                                    else "required", several))
        elif fmt is not None and fmt.type == "json_object":
            grammar = server._compile(lambda g: g.json_schema(None), "text.format")
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.schema_
            grammar = server._compile(lambda g: g.json_schema(schema), "text.format.schema")
        processors = server.grammar_processors(grammar, "tools" if names else "text.format")
        effort = req.reasoning.effort if req.reasoning else None
        asked = {"enable_thinking": False} if effort in ("none", "minimal") and getattr(
            server.engine, "think_tags", None) is not None else None
        template_kwargs = server.template_kwargs(asked, "reasoning.effort")
        kw: dict[str, Any] = {"max_tokens": server.limits.max_tokens(req.max_output_tokens,
                                                                     "max_output_tokens")}
        for field in ("temperature", "top_p"):
            if getattr(req, field) is not None:
                kw[field] = getattr(req, field)
        call = _Call(kind="chat", prompts=[lambda: server._chat_ids(messages, template_kwargs)],
                     prompt_param="input", params=SamplingParams(**kw), stream=req.stream,
                     include_usage=False, processors=processors,
                     thoughts=server.thoughts(None) if grammar is None else None)
        return await server.spelled(request, call, _Answer(req, server.model_name, names,
                                                           several))


class _Answer:
    """One response as it is generated: its output items, the stream's events for each step
    (``OpenAIServer.spelled`` calls them), and the response object at any point."""

    def __init__(self, req: ResponseRequest, model: str, tools: tuple[str, ...],
                 several: bool) -> None:
        self.req, self.model, self.tools, self.several = req, model, tools, several
        self.id, self.created = _id("resp"), _now()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.reasoning: dict[str, Any] | None = None  # the reasoning item, while open
        self.message: dict[str, Any] | None = None  # the message item, while open
        self.text = ""  # the message's text (the tool calls' JSON while tools are offered)
        self.reasoning_tokens = 0
        self.finish: FinishEvent | None = None
        self.failed: APIError | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    # -- steps ----------------------------------------------------------------------------------

    def begin(self) -> list[str]:
        return [self.event(kind, response=self.response("in_progress"))
                for kind in ("response.created", "response.in_progress")]

    def error(self, exc: APIError) -> str:
        return self.event("error", code=exc.code, message=exc.message, param=exc.param)

    def whole(self) -> dict[str, Any]:
        return self.response()

    def thought(self, text: str) -> list[str]:
        out = []
        if self.reasoning is None:
            self.reasoning = {"id": _id("rs"), "type": "reasoning", "summary": [],
                              "content": [], "status": "in_progress"}
            self.output.append(self.reasoning)
            out.append(self.event("response.output_item.added", output_index=self.index(
                self.reasoning), item=_copy(self.reasoning)))
            self.reasoning["content"].append({"type": "reasoning_text", "text": ""})
            out.append(self.event("response.content_part.added", **self.where(self.reasoning),
                                  part={"type": "reasoning_text", "text": ""}))
        self.reasoning["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", **self.where(self.reasoning),
                              delta=text))
        return out

    def token(self, event: TokenEvent) -> list[str]:
        if event.token_id >= 0 and self.reasoning is not None and self.message is None \
                and not event.text:
            self.reasoning_tokens += 1  # a token whose text went to the thought
        if not event.text:
            return []
        out = self.close_reasoning()
        if self.tools:  # the calls are known at the end
            self.text += event.text
            return out
        if self.message is None:
            out += self.open_message()
        self.text += event.text
        self.message["content"][0]["text"] = self.text
        out.append(self.event("response.output_text.delta", **self.where(self.message),
                              delta=event.text, logprobs=[]))
        return out

    def end(self, finish: FinishEvent) -> list[str]:
        from .app import _parse_tool_calls

        self.finish = finish
        status = "completed" if finish.reason != "length" else "incomplete"
        out = self.close_reasoning(status)
        calls = _parse_tool_calls(self.text, self.tools, self.several) if self.tools else None
        if calls is not None:
            for call in calls:
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call.id, "name": call.function.name, "arguments": ""}
                self.output.append(item)
                index = self.index(item)
                out.append(self.event("response.output_item.added", output_index=index,
                                      item=_copy(item)))
                args = call.function.arguments
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index, delta=args))
                out.append(self.event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index, name=item["name"],
                                      arguments=args))
                item.update(arguments=args, status="completed")
                out.append(self.event("response.output_item.done", output_index=index,
                                      item=_copy(item)))
        else:
            if self.message is None:
                out += self.open_message()
                if self.tools:  # plain text after all: sent whole
                    self.message["content"][0]["text"] = self.text
                    out.append(self.event("response.output_text.delta",
                                          **self.where(self.message), delta=self.text,
                                          logprobs=[]))
            where = self.where(self.message)
            part = self.message["content"][0]
            out.append(self.event("response.output_text.done", **where, text=part["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", **where, part=_copy(part)))
            self.message["status"] = status
            out.append(self.event("response.output_item.done",
                                  output_index=where["output_index"], item=_copy(self.message)))
            self.message = None
        final = self.response()
        out.append(self.event("response.completed" if status == "completed"
                              else "response.incomplete", response=final))
        return out

    # -- pieces -----------------------------------------------------------------------------------

    def open_message(self) -> list[str]:
        self.message = {"id": _id("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
        self.output.append(self.message)
        out = [self.event("response.output_item.added", output_index=self.index(self.message),
                          item=_copy(self.message))]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        out.append(self.event("response.content_part.added", **self.where(self.message),
                              part=_copy(part)))
        return out

    def close_reasoning(self, status: str = "completed") -> list[str]:
        if self.reasoning is None or self.reasoning["status"] != "in_progress":
            return []
        where = self.where(self.reasoning)
        part = self.reasoning["content"][0]
        self.reasoning["status"] = status
        return [self.event("response.reasoning_text.done", **where, text=part["text"]),
                self.event("response.content_part.done", **where, part=_copy(part)),
                self.event("response.output_item.done", output_index=where["output_index"],
                           item=_copy(self.reasoning))]

    def index(self, item: dict[str, Any]) -> int:
        return next(i for i, o in enumerate(self.output) if o is item)

    def where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index(item), "content_index": 0}

    def response(self, status: str | None = None) -> dict[str, Any]:
        req, finish = self.req, self.finish
        if status is None:
            status = "completed" if finish is None or finish.reason != "length" else "incomplete"
        fmt = req.text.format if req.text and req.text.format else FormatText(type="text")
        usage = None
        if finish is not None:
            usage = {"input_tokens": finish.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens": finish.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": finish.prompt_tokens + finish.completion_tokens}
        tool_choice = req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": req.instructions, "model": self.model,
            "output": [_copy(o) for o in self.output],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": tool_choice if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or ()],
            "max_output_tokens": req.max_output_tokens,
            "text": {"format": fmt.model_dump(by_alias=True)},
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": False, "metadata": req.metadata or {}, "usage": usage,
            "previous_response_id": None, "truncation": "disabled", "user": req.user,
        }


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def add_routes(app: FastAPI, server: Any, auth: list[Any]) -> None:
    """``POST /v1/responses`` on ``app`` over ``server``; errors are OpenAI-shaped as on the
    other /v1 routes."""
    api = ResponsesAPI(server)

    async def create(request: Request) -> Response:
        return await api.create(request)

    app.add_api_route("/v1/responses", create, methods=["POST"], dependencies=auth,
                      include_in_schema=False)


__all__ = ["ResponseRequest", "ResponsesAPI", "add_routes"]
