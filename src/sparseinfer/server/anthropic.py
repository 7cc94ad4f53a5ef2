"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over
the same engine and queue, for clients written for it (Anthropic's SDKs; Claude Code and other
agents pointed at a local server with ``ANTHROPIC_BASE_URL``, as llama.cpp's server and Ollama
allow).

What is served (tested through Anthropic's official Python client, its stream helper included):
- ``messages`` of user / assistant turns, content a string or blocks: ``text``, ``tool_use``
  (an earlier call) and ``tool_result`` (its answer), earlier ``thinking`` blocks (accepted, not
  shown to the model again); ``system`` as a string or text blocks. ``cache_control`` is
  accepted anywhere and changes nothing (the batch engine reuses a cached prompt beginning on
  its own).
- ``max_tokens`` (required, as Anthropic's API has it), ``temperature``, ``top_p``, ``top_k``
  (which Anthropic's current SDK no longer sends, older clients and llama.cpp's do),
  ``stop_sequences`` (``stop_reason: "stop_sequence"`` with the one that matched); ``tools``
  (``input_schema``) with ``tool_choice`` auto / any / tool / none and
  ``disable_parallel_tool_use``, by the chat route's constrained decoding, answered as
  ``tool_use`` blocks (``stop_reason: "tool_use"``); ``output_config.format`` (or the older
  ``output_format``) ``json_schema`` the same way; ``thinking`` enabled / disabled sets a
  thinking model's ``enable_thinking``, and its thoughts come back as a ``thinking`` block (with
  an empty ``signature``: nothing is signed).
- ``stream``: ``message_start``, ``content_block_start`` / ``_delta`` (``text_delta``,
  ``thinking_delta``, ``input_json_delta``) / ``_stop``, ``message_delta`` (stop reason, output
  tokens) and ``message_stop`` SSE events.
- The model may be named by the served id only (another is a 404, as on the OpenAI routes):
  set ``ANTHROPIC_MODEL`` (and Claude Code's small/fast model) to it. The API key may come as
  ``x-api-key`` or ``Authorization: Bearer``.
- Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``. Images,
  documents, server tools (web search, ...) and unknown fields are 400s naming them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..config import SamplingParams
from ..engine import FinishEvent, TokenEvent
from .protocol import APIError, FunctionDef, Tool
from .responses import _id

logger = logging.getLogger(__name__)

# -- requests -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Block(_Strict):
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: Any = None  # as Anthropic's answers carry them: changes nothing here
    toolset_name: str | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(discriminator="type")]]


class CustomTool(_Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # changes nothing


class MessagesRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the older spelling of output_config.format
    # accepted, change nothing: no cache, tier, region, speed or workspace to choose here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @property
    def schema(self) -> dict[str, Any] | None:
        fmt = self.output_config.format if self.output_config else None
        fmt = fmt or self.output_format
        return fmt.schema_ if fmt is not None else None


class CountRequest(MessagesRequest):
    max_tokens: int = 1  # counting needs none


# -- errors ---------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(exc.status, "api_error"),
                                       "message": exc.message}}


# -- the routes -----------------------------------------------------------------------------------


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


class MessagesAPI:
    """``/v1/messages`` over an ``app.OpenAIServer`` (its queue, prompt building, grammars,
    limits and thought splitting)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def check_model(self, name: str) -> None:
        server = self.server
        if name not in (server.model_name, server.engine.name):
            raise APIError(404, f"model: {name!r} is not served here; this server serves "
                           f"{server.model_name!r}", param="model")

    @staticmethod
    def chat(req: MessagesRequest | CountRequest) -> list[dict[str, str]]:
        """The conversation as chat messages: tool calls spelled as the model writes them,
        tool results as "tool" turns, earlier thoughts left out."""
        out = [{"role": "system", "content": _text(req.system)}] if req.system else []
        for m in req.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text, calls = "", []
            for b in m.content:
                if isinstance(b, TextBlock):
                    text += b.text
                elif isinstance(b, ToolUseBlock):
                    calls.append(json.dumps({"name": b.name, "arguments": b.input}))
                elif isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "content": _text(b.content)})
            if calls:
                text += calls[0] if len(calls) == 1 else "[" + ", ".join(calls) + "]"
            if text or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": m.role, "content": text})
        return out

    def prompt(self, req: MessagesRequest | CountRequest) -> tuple[
            list[dict[str, str]], Any, tuple[str, ...], bool, dict[str, Any] | None]:
        """(messages, grammar, tool names, several calls allowed, template variables)."""
        from .app import _tool_prompt, with_system_text

        server = self.server
        messages = self.chat(req)
        grammar, names, several = None, (), False
        choice = req.tool_choice
        if req.tools and (choice is None or choice.type != "none"):
            if choice is not None and choice.type == "tool" and choice.name not in [
                    t.name for t in req.tools]:
                raise APIError(400, f"tool_choice.name: no tool named {choice.name!r}",
                               param="tool_choice.name")
            if req.schema is not None:
                raise APIError(400, "output_config.format: cannot be combined with tools",
                               param="output_config.format")
            named = choice.name if choice is not None and choice.type == "tool" else None
            chosen = [t for t in req.tools if named is None or t.name == named]
            names = tuple(t.name for t in req.tools)
            several = named is None and not (choice and choice.disable_parallel_tool_use)
            mode = "auto" if choice is None or choice.type == "auto" else "required"
            specs = [(t.name, t.input_schema) for t in chosen]
            grammar = server._compile(lambda g: g.tool_calls(specs, mode, several), "tools")
            as_chat = [Tool(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.input_schema))
                for t in chosen]
            with_system_text(messages, _tool_prompt(as_chat, mode, several))
        elif req.schema is not None:
            schema = req.schema
            grammar = server._compile(lambda g: g.json_schema(schema),
                                      "output_config.format.schema")
        asked = None
        if req.thinking is not None and getattr(server.engine, "think_tags", None) is not None:
            asked = {"enable_thinking": req.thinking.type != "disabled"}
        return messages, grammar, names, several, server.template_kwargs(asked, "thinking")

    async def count_tokens(self, request: Request) -> Response:
        server = self.server
        req: CountRequest = await server.parse(request, CountRequest)
        self.check_model(req.model)
        messages, _, _, _, template_kwargs = self.prompt(req)
        ids = await server.one_result(
            request, lambda job: job.emit(server._chat_ids(messages, template_kwargs)))
        if ids is None:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": len(ids)})

    async def create(self, request: Request) -> Response:
        from .app import _Call

        server = self.server
        req: MessagesRequest = await server.parse(request, MessagesRequest)
        self.check_model(req.model)
        messages, grammar, names, several, template_kwargs = self.prompt(req)
        processors = server.grammar_processors(grammar,
                                               "tools" if names else "output_config.format")
        kw: dict[str, Any] = {"max_tokens": server.limits.max_tokens(req.max_tokens, "max_tokens"),
                              "stop": tuple(s for s in req.stop_sequences or () if s)}
        for field in ("temperature", "top_p", "top_k"):
            if getattr(req, field) is not None:
                kw[field] = getattr(req, field)
        answer = _Answer(server.model_name, names, several)

        def prompt() -> list[int]:  # on the worker, before any event: message_start's count
            ids = server._chat_ids(messages, template_kwargs)
            answer.prompt_tokens = len(ids)
            return ids

        call = _Call(kind="chat", prompts=[prompt], prompt_param="messages",
                     params=SamplingParams(**kw), stream=req.stream, include_usage=False,
                     processors=processors,
                     thoughts=server.thoughts(None) if grammar is None else None)
        return await server.spelled(request, call, answer)


def _sse(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


class _Answer:
    """One message as it is generated: its content blocks and the stream's events
    (``OpenAIServer.spelled`` calls them)."""

    def __init__(self, model: str, tools: tuple[str, ...], several: bool) -> None:
        self.model, self.tools, self.several = model, tools, several
        self.id = _id("msg")
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block being streamed
        self.held = ""  # the answer's text while tools are offered (calls are parsed at the end)
        self.prompt_tokens = 0
        self.finish: FinishEvent | None = None
        self.failed: APIError | None = None

    def begin(self) -> list[str]:
        """``message_start`` (the prompt's tokens were counted as it was built)."""
        return [_sse("message_start", {"type": "message_start", "message": {
            **self.whole(), "content": [], "stop_reason": None, "stop_sequence": None}})]

    @staticmethod
    def error(exc: APIError) -> str:
        return _sse("error", error_body(exc))

    def open_block(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.blocks.append(block)
        self.open = block
        empty = {**block, **({"text": ""} if block["type"] == "text" else {}),
                 **({"thinking": ""} if block["type"] == "thinking" else {})}
        out.append(_sse("content_block_start", {"type": "content_block_start",
                                                "index": len(self.blocks) - 1,
                                                "content_block": empty}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        index = len(self.blocks) - 1
        if self.open["type"] == "thinking":  # nothing is signed: an empty signature
            out.append(_sse("content_block_delta", {"type": "content_block_delta",
                                                    "index": index, "delta": {
                                                        "type": "signature_delta",
                                                        "signature": ""}}))
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        self.open = None
        return out

    def delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta",
                                            "index": len(self.blocks) - 1, "delta": delta})

    def thought(self, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != "thinking":
            out += self.open_block({"type": "thinking", "thinking": "", "signature": ""})
        self.open["thinking"] += text
        out.append(self.delta({"type": "thinking_delta", "thinking": text}))
        return out

    def token(self, event: TokenEvent) -> list[str]:
        if not event.text:
            return []
        if self.tools:  # calls or text: decided at the end
            self.held += event.text
            return self.close()
        out = []
        if self.open is None or self.open["type"] != "text":
            out += self.open_block({"type": "text", "text": ""})
        self.open["text"] += event.text
        out.append(self.delta({"type": "text_delta", "text": event.text}))
        return out

    def end(self, finish: FinishEvent) -> list[str]:
        from .app import _parse_tool_calls

        self.finish = finish
        self.prompt_tokens = finish.prompt_tokens
        out = []
        calls = _parse_tool_calls(self.held, self.tools, self.several) if self.tools else None
        if calls is not None:
            for call in calls:
                args = call.function.arguments
                out += self.open_block({"type": "tool_use", "id": "toolu_" + call.id[5:],
                                   "name": call.function.name, "input": {}})
                self.open["input"] = json.loads(args)
                out.append(self.delta({"type": "input_json_delta", "partial_json": args}))
        elif self.held or not self.blocks or self.blocks[-1]["type"] != "text":
            if self.open is None or self.open["type"] != "text":
                out += self.open_block({"type": "text", "text": ""})
            if self.held:
                self.open["text"] += self.held
                out.append(self.delta({"type": "text_delta", "text": self.held}))
        out += self.close()
        reason, stop = self.stop_reason(calls is not None)
        out.append(_sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": stop}, "usage": {
            "output_tokens": finish.completion_tokens}}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out

    def stop_reason(self, called: bool) -> tuple[str | None, str | None]:
        finish = self.finish
        if finish is None:
            return None, None
        if called:
            return "tool_use", None
        if finish.reason == "length":
            return "max_tokens", None
        if finish.stop_string is not None:
            return "stop_sequence", finish.stop_string
        return "end_turn", None

    def whole(self) -> dict[str, Any]:
        reason, stop = self.stop_reason(any(b["type"] == "tool_use" for b in self.blocks))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": json.loads(json.dumps(self.blocks)), "stop_reason": reason,
                "stop_sequence": stop,
                "usage": {"input_tokens": self.prompt_tokens,
                          "output_tokens": self.finish.completion_tokens if self.finish else 0,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def add_routes(app: FastAPI, server: Any, auth: list[Any]) -> None:
    """Anthropic's routes on ``app`` over ``server``; their errors are Anthropic-shaped."""
    api = MessagesAPI(server)

    def answer(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return JSONResponse(error_body(exc), status_code=exc.status,
                                    headers=exc.headers)

        return run

    for path, handler in (("/v1/messages", api.create),
                          ("/v1/messages/count_tokens", api.count_tokens)):
        app.add_api_route(path, answer(handler), methods=["POST"], dependencies=auth,
                          include_in_schema=False)


__all__ = ["MessagesAPI", "add_routes", "error_body"]
