"""Pydantic models of the OpenAI HTTP API subset that sparseinfer serves.

Requests are validated strictly (``"12"`` is not an integer, ``1.0`` is not ``n``) so that a wrong
type is a 400 naming the field rather than a silent coercion. Unknown fields are ignored, as
OpenAI-compatible servers commonly do, so clients that send extra options keep working.

Responses mirror the shapes of ``openai.types`` (``chat.completion``, ``chat.completion.chunk``,
``text_completion``, ``list`` of ``model``) so the official client parses them.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    where = param or "request body"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r:.80})"
    return APIError(400, f"{where}: {err['msg']}{shown}", param=param, code="invalid_value")


# -- requests -----------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # optional here (llama.cpp-style); must match the served id if given
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
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


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> APIError | None:
        if self.logprobs:
            return APIError(400, "logprobs: not supported by this server", param="logprobs")
        if self.top_logprobs:
            return APIError(400, "top_logprobs: not supported by this server", param="top_logprobs")
        return None

    @property
    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_SamplingRequest):
    # a string, one string in a list, or token ids (one prompt); batches are rejected (n=1 only)
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> APIError | None:
        if self.echo:
            return APIError(400, "echo: not supported by this server", param="echo")
        if self.logprobs is not None:
            return APIError(400, "logprobs: not supported by this server", param="logprobs")
        if self.suffix:
            return APIError(400, "suffix: not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            return APIError(
                400, f"best_of: only 1 is supported, got {self.best_of}", param="best_of"
            )
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; a batch of several prompts is a 400."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise APIError(
                400, "prompt: expected a string or a list of token ids, got []", param="prompt"
            )
        if isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        if len(p) != 1:
            raise APIError(
                400,
                f"prompt: only one prompt per request is supported, got {len(p)}",
                param="prompt",
            )
        return p[0]  # type: ignore[return-value]


# -- responses ----------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparseinfer"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: None = None
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
