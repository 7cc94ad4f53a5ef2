"""Pydantic models of the OpenAI HTTP API subset that sparseinfer serves.

Requests are validated strictly (``"12"`` is not an integer, ``1.0`` is not ``n``) so that a wrong
type is a 400 naming the field rather than a silent coercion. Unknown fields are a 400 naming
them too, so an option this server does not implement is never silently dropped.

Responses mirror the shapes of ``openai.types`` (``chat.completion``, ``chat.completion.chunk``,
``text_completion``, ``list`` of ``model``) so the official client parses them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

# -- errors -------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        )


_UNION_TAGS = {"str", "int", "float", "bool"}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """Dotted path of a pydantic error location, for ``param`` and messages:
    ``('messages', 0, 'content', 'list[TextPart]', 1, 'type')`` -> ``messages[0].content[1].type``.

    Pydantic puts the tried union member (``'str'``, ``'list[str]'``) into ``loc``; those are not
    fields and are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD.match(part) and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: ValidationError) -> APIError:
    """The first problem of a pydantic ``ValidationError`` as a 400 naming the field."""
    errors = exc.errors(include_url=False)
    # a failed union reports every member; the deepest location is the most specific complaint
    err = max(errors, key=lambda e: len(e["loc"]))
    if any(e["type"] == "json_invalid" for e in errors):
        err = next(e for e in errors if e["type"] == "json_invalid")
    if err["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    param = _param_path(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return APIError(
            400,
            f"{param}: unknown or unsupported field; this server does not implement it",
            param=param,
            code="unsupported_field",
        )
    where = param or "request body"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r:.80})"
    return APIError(400, f"{where}: {err['msg']}{shown}", param=param, code="invalid_value")


# -- requests -----------------------------------------------------------------------------------

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs / completions logprobs
MAX_CHOICES = 16  # n, and prompts x n of one request: bounded work per request


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    # OpenAI pads chunks against length side channels by default; this server adds no padding
    # and accepts only the setting that says so
    include_obfuscation: Literal[False] | None = None


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # optional here (llama.cpp-style); must match the served id if given
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted, change nothing in the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # llama.cpp server extensions
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return tuple(s for s in stops if s)  # an empty stop string would end every generation

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def bias(self, vocab_size: int | None) -> dict[int, float]:
        """``logit_bias`` as {token id: bias}; a 400 for a key that is not a token id or a
        bias outside [-100, 100] (OpenAI's range)."""
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() also takes "¹" or "²", which int() refuses
            if not (key.isascii() and key.isdigit()) or (vocab_size is not None
                                                         and int(key) >= vocab_size):
                where = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise APIError(
                    400,
                    f"logit_bias: expected token ids{where} as keys, got {key!r:.40}",
                    param="logit_bias",
                )
            if not -100.0 <= value <= 100.0:
                raise APIError(
                    400,
                    f"logit_bias: expected biases in [-100, 100], got {value} for {key}",
                    param="logit_bias",
                )
            out[int(key)] = value
        return out


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer
    refusal: str | None = None
    # an earlier answer's thoughts, as this server returned them: not shown to the model again
    # (thinking models' templates drop earlier turns' thoughts too)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(p.text for p in self.content)
        calls = [  # shown to the model in the shape it was asked for: an object, or an array
            f'{{"name": "{c.function.name}", "arguments": {c.function.arguments}}}'
            for c in self.tool_calls or ()
        ]
        if len(calls) > 1:
            return text + "[" + ", ".join(calls) + "]"
        return text + "".join(calls)


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = Field(None, discriminator="type")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    # llama.cpp server extensions: more variables for the chat template (e.g. Qwen3's
    # {"enable_thinking": false}), and whether a thinking model's thoughts come apart from its
    # answer ("auto" / "deepseek": as reasoning_content; "none": left in the content)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None

    def unsupported(self) -> APIError | None:
        if self.max_tokens == 0:
            return APIError(400, "max_tokens: expected >= 1 for chat, got 0", param="max_tokens")
        if self.top_logprobs and not self.logprobs:
            return APIError(
                400, "top_logprobs: needs logprobs: true", param="top_logprobs"
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            return APIError(400, "tool_choice: given without tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                return APIError(
                    400,
                    f"tool_choice: no tool named {self.tool_choice.function.name!r}; "
                    f"tools are {names}",
                    param="tool_choice",
                )
        if self.tools and self.tool_choice != "none" and self.response_format is not None and (
            self.response_format.type != "text"
        ):
            return APIError(
                400,
                "response_format: cannot be combined with tools (use one or the other)",
                param="response_format",
            )
        return None

    @property
    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_SamplingRequest):
    # a string, token ids, or a list of either (several prompts: one choice per prompt x n)
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> APIError | None:
        if self.suffix:
            return APIError(400, "suffix: not supported by this server", param="suffix")
        if self.best_of not in (None, self.n):
            return APIError(
                400,
                f"best_of: only best_of == n ({self.n}) is supported, got {self.best_of}",
                param="best_of",
            )
        if self.max_tokens == 0 and self.stream:
            return APIError(
                400, "max_tokens: 0 is only supported without stream", param="max_tokens"
            )
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one or several); an empty list is a 400."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(
                400, "prompt: expected a string or a list of token ids, got []", param="prompt"
            )
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) * self.n > MAX_CHOICES:
            raise APIError(
                400,
                f"prompt: {len(p)} prompts x n={self.n} is more than {MAX_CHOICES} choices "
                "per request",
                param="prompt",
            )
        return list(p)  # type: ignore[arg-type]


MAX_EMBEDDING_INPUTS = 256  # texts per /v1/embeddings request (OpenAI takes 2048): bounded work


class EmbeddingRequest(_Request):
    # a string, token ids, or a list of either (one vector per text, in order)
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # accepted, not used

    def unsupported(self) -> APIError | None:
        if self.dimensions is not None:
            return APIError(400, "dimensions: not supported by this server (its vectors have "
                            "the model's hidden size)", param="dimensions")
        return None

    def texts(self) -> list[str | list[int]]:
        """The request's texts (one or several); an empty one, or too many, is a 400."""
        p = self.input
        if not p:
            raise APIError(400, f"input: expected a non-empty string, token ids or a list of "
                           f"either, got {p!r}", param="input")
        if isinstance(p, str) or isinstance(p[0], int):
            return [p if isinstance(p, str) else list(p)]  # type: ignore[list-item]
        if len(p) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input: {len(p)} texts is more than {MAX_EMBEDDING_INPUTS} "
                           f"per request", param="input")
        for i, t in enumerate(p):
            if not t:
                raise APIError(400, f"input[{i}]: expected a non-empty string or token ids, "
                               f"got {t!r}", param="input")
        return list(p)  # type: ignore[arg-type]


# -- responses ----------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparseinfer"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class _WithReasoning(_Response):
    """A message or delta whose ``reasoning_content`` (a thinking model's thoughts, as
    llama.cpp's server names them) appears only when there is some."""

    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_reasoning(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class AssistantMessage(_WithReasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_WithReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    """The legacy completions shape: one entry per token (echoed prompt tokens first; the first
    prompt token has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(_Response):
    """Both the non-streamed answer and each streamed chunk of ``/v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Health(_Response):
    status: Literal["ok"] = "ok"
    model: str
    running: int
    queued: int
    max_queue: int


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
