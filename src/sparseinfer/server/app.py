"""OpenAI-compatible HTTP server over an engine (``sparseinfer.engine.EngineProtocol``).

Routes: ``GET /health`` (never needs a key), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (both also as SSE streams),
``POST /v1/embeddings``; OpenAI's Responses API, ``POST /v1/responses``
(``server/responses.py``); Anthropic's Messages API, ``POST /v1/messages``
(``server/anthropic.py``); and Ollama's own API, ``/api/*`` (``server/ollama.py``).

How requests are served
- Every generation request becomes a job in a bounded FIFO (``queue.Scheduler``): one job runs
  on the single worker thread (the engine is not thread-safe; templating and tokenizing run there
  too), at most ``max_queue`` wait in arrival order. A request arriving when the line is full is
  answered 429 with ``Retry-After``.
- A client that disconnects, while waiting or while streaming, withdraws its job at once: its
  waiting slot is freed, or the engine's cancel event is set and the worker moves on.
- A streamed response starts (HTTP 200) when the first token exists, so a prompt that does not fit
  still gets a proper 400 instead of an error inside a 200 stream.

Choices
- ``max_tokens`` (``max_completion_tokens`` for chat): unset takes the server's
  ``default_max_tokens`` (``serve --default-max-tokens``; None: until end of text or the context
  is full); above ``max_tokens_limit`` is a 400; larger than the room the prompt leaves in the
  context window is clamped to that room (``finish_reason="length"``). Completions accept 0
  (with ``echo``: score the prompt only). ``max_generation_seconds`` ends a longer generation
  with ``finish_reason="length"``.
- A prompt that leaves no room for one generated token is a 400 ``context_length_exceeded``.
- Unset sampling fields take ``SamplingParams`` defaults (llama.cpp's: temperature 0.8, top_k 40,
  top_p 0.95, min_p 0.05), not OpenAI's; ``top_k``, ``min_p`` and ``repeat_penalty`` are accepted
  as extensions. A temperature too small for float32 is greedy.
- ``seed``: the same request with the same seed gives the same text whatever ran before (a seeded
  request never reuses another request's KV prefix). With ``n > 1`` choice i uses seed + i.
- ``n`` (and completions' lists of prompts: choice index = prompt * n + k) run one after another
  in the request's job; at most 16 choices per request.
- ``logprobs``: log-softmax of the logits each token was drawn from, after penalties,
  ``logit_bias`` and grammar masks, before temperature / top-k / top-p. Completions ``echo`` +
  ``logprobs`` scores the prompt tokens too (the first has none), as lm-eval needs.
- ``response_format`` (``json_object``, ``json_schema``) and ``tools`` (``tool_choice`` auto,
  required, named) are enforced by constrained decoding (xgrammar, ``structured.py``); the tools
  are prompted as a system message and an answer of calls comes back as ``tool_calls``: one or
  more (a JSON array) unless ``parallel_tool_calls`` is false or ``tool_choice`` names a tool,
  each with its own id; streamed as one chunk per call (its ``index``, id, name, arguments).
- ``/v1/embeddings``: one unit-length vector per text (a string or token ids; up to 256 a
  request), the model's final-normed hidden states pooled as ``serve --pooling`` says (mean over
  every token by default, or the last token's; llama.cpp's ``--pooling``), as floats or
  ``encoding_format: "base64"`` (little-endian float32, what the official client asks for). A
  text may fill the whole context; ``dimensions`` is a 400.
- A thinking model's thoughts (``engine.think_tags``: its template names ``<think>``) come back
  as ``message.reasoning_content`` / ``delta.reasoning_content`` apart from the answer
  (``reasoning.py``; llama.cpp's default), unless ``reasoning_format`` (the request's, else
  ``serve --reasoning-format``) is "none" or the answer is constrained (``response_format``,
  ``tools``). ``chat_template_kwargs`` (the server's, then the request's) are more variables
  for the chat template, e.g. Qwen3's ``enable_thinking``.
- Every other field a client sends that this server does not implement is a 400 naming it.
- Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status;
  ``/openapi.json`` declares the request bodies and these error shapes.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SamplingParams
from ..engine import EngineProtocol, FinishEvent, TokenEvent
from ..errors import ContextOverflowError, SparseInferError
from ..generate import POOLINGS
from ..reasoning import ThinkTags, ThoughtSplitter
from ..tokenizer import TEMPLATE_VARIABLES
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    Health,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    validation_error,
)
from .structured import GrammarError, GrammarProcessor, Grammars, LogitBias
from .queue import END, Job, JobFailed, QueueFullError, Scheduler
from .webui import index_html

logger = logging.getLogger(__name__)

_GONE = object()  # event injected when the client disconnects
_DRAIN_LIMIT = 64 << 20  # bytes of an oversized body read and dropped so the client sees the 413
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
REASONING_FORMATS = ("auto", "deepseek", "none")  # llama.cpp's --reasoning-format (deepseek = auto)
_PROMPT_TAIL = 16  # tokens at the end of a chat prompt looked at for a thought left open


class _ClientGone(Exception):
    """The client disconnected while its request body was being read."""


@dataclass(frozen=True)
class _Call:
    """What one generation request asks for, resolved on the event loop."""

    kind: str  # "chat" | "text"
    prompts: list[Callable[[], list[int]]]  # builders, run on the worker thread; one per prompt
    prompt_param: str  # the request field a prompt problem is blamed on
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt's text (and logprobs) lead each choice
    echo_texts: tuple[str | None, ...] = ()  # the prompt strings as sent (None: decode the ids)
    logprobs: int | None = None  # alternatives per token; None: no logprobs at all
    processors: Callable[[], list[Any]] | None = None  # fresh logits processors per choice
    tools: tuple[str, ...] = ()  # names of the tools the answer may call
    several: bool = False  # the answer may be a JSON array of calls (parallel_tool_calls)
    thoughts: ThinkTags | None = None  # a thinking model's thoughts come apart (``Thought``)

    @property
    def n_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass(frozen=True)
class Thought:
    """Text of a thinking model's thoughts (the event that carries it: ``reasoning_content`` /
    Ollama's ``thinking``), sent on the job before the answer's tokens."""

    text: str


@dataclass(frozen=True)
class _Logprob:
    """One token's logprob entry, spelled out on the worker thread."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class _Echo:
    """The prompt that leads a choice (``echo``), with its tokens' logprobs if asked."""

    text: str
    logprobs: tuple[_Logprob, ...]


@dataclass(frozen=True)
class _Limits:
    """Server-side bounds on generation (``serve --max-tokens / --max-tokens-limit /
    --max-generation-seconds``); None = unbounded (the context window still is a bound)."""

    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "max_tokens_limit", "max_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: expected > 0 or None, got {value}")

    def max_tokens(self, asked: int | None, param: str) -> int:
        """The token budget of a request (-1: until end of text or the context is full)."""
        if asked is None:
            asked = self.default_max_tokens
            if asked is None:
                return -1 if self.max_tokens_limit is None else self.max_tokens_limit
        if self.max_tokens_limit is not None and asked > self.max_tokens_limit:
            raise APIError(
                400,
                f"{param}: this server generates at most {self.max_tokens_limit} tokens per "
                f"request, got {asked}",
                param=param,
            )
        return asked


def _sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
    """Map the OpenAI request fields onto SamplingParams (unset fields keep its defaults)."""
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    for field in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repeat_penalty",
    ):
        value = getattr(req, field)
        if value is not None:
            kw[field] = value
    if req.seed is not None:
        kw["seed"] = req.seed % (1 << 63)  # any JSON integer OpenAI accepts -> a valid RNG seed
    kw["stop"] = req.stop_strings()
    return SamplingParams(**kw)


def _tool_prompt(tools: list[Tool], choice: Any, several: bool) -> str:
    """The system text that tells the model which tools exist and how to call them."""
    specs = [
        {
            "name": t.function.name,
            "description": t.function.description or "",
            "parameters": t.function.parameters or {"type": "object"},
        }
        for t in tools
    ]
    more = ", or a JSON array of such objects to call several tools at once" if several else ""
    how = (
        "If a tool helps, answer with only a JSON object "
        f'{{"name": <tool name>, "arguments": <arguments object>}}{more}; otherwise answer '
        "normally."
        if choice in (None, "auto")
        else f'Answer with only a JSON object {{"name": <tool name>, "arguments": <arguments>}}'
        f"{more}."
    )
    return "You can call these tools:\n" + json.dumps(specs) + "\n" + how


def with_system_text(messages: list[dict[str, str]], text: str) -> None:
    """Add ``text`` to the chat's system message (after its own, or as a new first one)."""
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})


def _parse_tool_calls(text: str, names: tuple[str, ...], several: bool) -> list[ToolCall] | None:
    """The tool calls a (grammar-constrained) answer spells: one JSON call object or, with
    ``several``, an array of them; each call gets its own id. None if it is plain text."""
    if not text.lstrip().startswith(("{", "[") if several else "{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(
        isinstance(c, dict) and c.get("name") in names and "arguments" in c for c in items
    ):
        return None
    return [
        ToolCall(
            id="call_" + uuid.uuid4().hex[:24],
            function=FunctionCallOut(name=c["name"], arguments=json.dumps(c["arguments"])),
        )
        for c in items
    ]


class _Choices:
    """What the events of a job say, per choice index (the non-streamed answer's material)."""

    def __init__(self, n: int) -> None:
        self.text = [""] * n
        self.thinking: list[str | None] = [None] * n
        self.echo: list[_Echo | None] = [None] * n
        self.logprobs: list[list[_Logprob]] = [[] for _ in range(n)]
        self.finish: list[FinishEvent | None] = [None] * n

    def add(self, index: int, event: Any, lp: _Logprob | None) -> None:
        if isinstance(event, _Echo):
            self.echo[index] = event
        elif isinstance(event, Thought):
            self.thinking[index] = (self.thinking[index] or "") + event.text
        elif isinstance(event, TokenEvent):
            self.text[index] += event.text
            if lp is not None:
                self.logprobs[index].append(lp)
        elif isinstance(event, FinishEvent):
            self.finish[index] = event


def _apart(events: Iterator[Any], splitter: ThoughtSplitter) -> Iterator[Any]:
    """A generation's events with its thoughts apart: each token's text split into a
    ``Thought`` and the answer's part (the token event, its text replaced); what the splitter
    still holds at the end comes out before the finish."""
    try:
        for event in events:
            if isinstance(event, TokenEvent):
                thinking, answer = splitter.push(event.text)
                if thinking:
                    yield Thought(thinking)
                yield replace(event, text=answer)
                continue
            if isinstance(event, FinishEvent):
                thinking, answer = splitter.flush()
                if thinking:
                    yield Thought(thinking)
                if answer:
                    yield TokenEvent(-1, answer)
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def _usage(finishes: list[FinishEvent | None], n: int) -> Usage:
    """Prompt tokens count once per prompt (not per choice), completion tokens per choice."""
    done = [f for f in finishes if f is not None]
    prompt = sum(f.prompt_tokens for i, f in enumerate(finishes) if f is not None and i % n == 0)
    completion = sum(f.completion_tokens for f in done)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion_logprobs(entries: list[_Logprob], start: int = 0) -> CompletionLogprobs:
    offsets, pos = [], start
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[dict(e.top) if e.logprob is not None else None for e in entries],
        text_offset=offsets,
    )


def _chat_logprobs(entries: list[_Logprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprob(
                token=e.token,
                logprob=e.logprob if e.logprob is not None else 0.0,
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


class OpenAIServer:
    """The routes' logic: request parsing, the job queue, response shaping."""

    def __init__(
        self,
        engine: EngineProtocol,
        *,
        model_name: str | None,
        api_key: str | None,
        max_queue: int,
        max_body_bytes: int,
        limits: _Limits | None = None,
        metrics: Metrics | None = None,
        pooling: str = "mean",
        reasoning_format: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected >= 1, got {max_body_bytes}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {sorted(POOLINGS)}, got {pooling!r}")
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format: expected one of {list(REASONING_FORMATS)}, "
                             f"got {reasoning_format!r}")
        self.pooling = pooling
        self.reasoning_format = reasoning_format
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.engine = engine
        self.model_name = model_name or engine.name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        # one worker per stream the engine can serve at once (BatchEngine.parallel)
        self.scheduler = Scheduler(max_queue, workers=getattr(engine, "parallel", 1))
        self.created = int(time.time())
        self.limits = limits or _Limits()
        self.metrics = metrics or Metrics()
        self._grammar_cache: Grammars | None = None

    # -- request parsing --------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401,
                "missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` (else 413). Reads the ASGI messages
        directly: an oversized body is drained (up to _DRAIN_LIMIT) but never kept."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isascii() and declared.isdigit() and int(declared) > limit
        if too_big and int(declared) > _DRAIN_LIMIT:
            raise self._too_large(int(declared), close=True)
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            body = message.get("body", b"")
            total += len(body)
            if not too_big:
                chunks.append(body)
                too_big = total > limit
            if total > _DRAIN_LIMIT:  # stop reading; the rest is never looked at
                raise self._too_large(total, close=True, partial=True)
            if not message.get("more_body", False):
                break
        if too_big:
            raise self._too_large(total)
        return b"".join(chunks)

    def _too_large(self, size: int, close: bool = False, partial: bool = False) -> APIError:
        found = f"more than {size} bytes" if partial else f"{size} bytes"
        return APIError(
            413,
            f"request body: {found} is larger than the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"} if close else None,
        )

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = await self.read_body(request)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(
                400,
                f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                code="invalid_encoding",
            ) from None
        if not text.strip():
            raise APIError(
                400, "request body is empty; expected a JSON object", code="invalid_json"
            )
        try:
            return model.model_validate_json(text)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model is not None and req.model not in (self.model_name, self.engine.name):
            raise APIError(
                404,
                f"model: the model {req.model!r} does not exist; this server serves "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        problem = req.unsupported()
        if problem is not None:
            raise problem

    def _processors(self, req: ChatCompletionRequest | CompletionRequest,
                    grammar: Any = None) -> Callable[[], list[Any]] | None:
        """A factory of fresh logits processors per choice: logit_bias, then a grammar."""
        bias = req.bias(getattr(self.engine, "vocab_size", None))
        if not bias and grammar is None:
            return None
        if not self._supports("processors"):
            raise APIError(
                400,
                "logit_bias / response_format / tools: this engine has no logits processors",
                param="logit_bias" if bias else "response_format",
            )
        vocab = getattr(self.engine, "vocab_size", None) or 0
        bias_proc = LogitBias(bias) if bias else None

        def make() -> list[Any]:
            procs: list[Any] = [bias_proc] if bias_proc is not None else []
            if grammar is not None:
                procs.append(GrammarProcessor(grammar, vocab))
            return procs

        return make

    def _supports(self, keyword: str) -> bool:
        """Whether the engine's ``stream`` takes ``keyword`` (processors / logprobs)."""
        try:
            return keyword in inspect.signature(self.engine.stream).parameters
        except (TypeError, ValueError):
            return False

    def _grammars(self) -> Grammars:
        if self._grammar_cache is None:
            self._grammar_cache = Grammars(self.engine)
        return self._grammar_cache

    def _compile(self, what: Callable[[Grammars], Any], param: str) -> Any:
        try:
            return what(self._grammars())
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    # -- prompt building (worker thread) ---------------------------------------------------

    def thoughts(self, reasoning_format: str | None) -> ThinkTags | None:
        """The think tags whose thoughts come apart from the answer: the model's, unless the
        request's (else the server's) reasoning format is "none"."""
        if (reasoning_format or self.reasoning_format) == "none":
            return None
        return getattr(self.engine, "think_tags", None)

    def template_kwargs(self, asked: dict[str, Any] | None,
                        param: str = "chat_template_kwargs") -> dict[str, Any] | None:
        """The chat template's extra variables: the server's, then the request's."""
        taken = sorted(set(asked or ()) & set(TEMPLATE_VARIABLES))
        if taken:
            raise APIError(400, f"{param}: expected names other than "
                           f"{', '.join(TEMPLATE_VARIABLES)}, got {', '.join(taken)}", param=param)
        merged = {**self.chat_template_kwargs, **(asked or {})}
        return merged or None

    def _chat_ids(self, messages: list[dict[str, str]],
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            return self.engine.chat_prompt(messages, template_kwargs)
        except UnicodeError as exc:
            raise APIError(
                400, f"messages: text is not encodable: {exc}", param="messages"
            ) from None
        except (SparseInferError, ValueError) as exc:
            raise APIError(
                400, f"messages: the chat template rejected them: {exc}", param="messages"
            ) from None
        except Exception as exc:  # jinja2 TemplateError etc.: user-shaped input, not a crash
            if type(exc).__module__.startswith("jinja2"):
                raise APIError(
                    400, f"messages: the chat template rejected them: {exc}", param="messages"
                ) from None
            raise

    def _text_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, list):
            vocab = getattr(self.engine, "vocab_size", None)
            bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise APIError(
                    400,
                    f"{param}: token id {bad[0]} is outside the vocabulary"
                    + (f" [0, {vocab})" if vocab is not None else ""),
                    param=param,
                )
            if vocab is None:  # let the tokenizer judge the ids (it raises for unknown ones)
                try:
                    self.engine.decode(prompt)
                except (SparseInferError, ValueError, IndexError, KeyError, OverflowError) as exc:
                    raise APIError(400, f"{param}: {exc}", param=param) from None
            return prompt
        try:
            return self.engine.encode(prompt, add_bos=True)
        except UnicodeError as exc:
            raise APIError(400, f"{param}: text is not encodable: {exc}", param=param) from None

    def _work(self, call: _Call) -> Callable[[Job], None]:
        engine = self.engine
        limits = self.limits
        kwargs: dict[str, Any] = {}
        if call.logprobs is not None:
            kwargs["logprobs"] = call.logprobs

        def spell(tok: int) -> str:
            return engine.decode([tok])

        def entry(tok: int, lp: float | None, top: Any) -> _Logprob:
            return _Logprob(spell(tok), lp, tuple((spell(t), p) for t, p in top))

        def work(job: Job) -> None:
            started = time.monotonic()
            deadline = None if limits.max_seconds is None else started + limits.max_seconds
            n_ctx = engine.n_ctx
            prompts = [build() for build in call.prompts]  # every prompt checked before any runs
            for ids in prompts:
                if not ids:
                    raise APIError(
                        400, f"{call.prompt_param}: the prompt is empty", param=call.prompt_param
                    )
                if len(ids) >= n_ctx:
                    raise APIError(
                        400,
                        f"{call.prompt_param}: this model's maximum context length is {n_ctx} "
                        f"tokens but the prompt has {len(ids)} tokens, leaving no room for the "
                        "completion",
                        param=call.prompt_param,
                        code="context_length_exceeded",
                    )
            for p, ids in enumerate(prompts):
                echo = None
                if call.echo:
                    scores = ()
                    if call.logprobs is not None:
                        scores = tuple(
                            entry(s.token_id, s.logprob, s.top)
                            for s in engine.score(ids, call.logprobs)
                        )
                    text = call.echo_texts[p] if p < len(call.echo_texts) else None
                    echo = _Echo(engine.decode(ids) if text is None else text, scores)
                opened = call.thoughts is not None and call.thoughts.opened_by(
                    engine.decode(ids[-_PROMPT_TAIL:]))
                room = n_ctx - len(ids)
                params = call.params
                if params.max_tokens < 0 or params.max_tokens > room:
                    params = replace(params, max_tokens=room)
                for k in range(call.n):
                    index = p * call.n + k
                    if echo is not None:
                        job.emit((index, echo, None))
                    choice = params
                    if params.seed is not None and k:
                        choice = replace(params, seed=(params.seed + k) % (1 << 63))
                    if params.max_tokens == 0 or (deadline and time.monotonic() > deadline):
                        job.emit((index, FinishEvent("length", len(ids), 0), None))
                        continue
                    if call.processors is not None:
                        kwargs["processors"] = call.processors()
                    events = engine.stream(ids, choice, job.cancel, **kwargs)
                    if call.thoughts is not None:
                        events = _apart(events, ThoughtSplitter(call.thoughts, opened))
                    if not self._generate(job, index, events, len(ids), deadline, entry, call):
                        return

        return work

    def _generate(self, job: Job, index: int, events: Any, n_prompt: int,
                  deadline: float | None, entry: Callable[..., _Logprob], call: _Call) -> bool:
        """Forward one choice's events to the job; False when the job was cancelled."""
        n_out = 0
        last = time.monotonic()
        try:
            for event in events:
                lp = None
                if isinstance(event, Thought):
                    job.emit((index, event, None))
                    continue
                if isinstance(event, TokenEvent) and event.token_id >= 0:
                    n_out += 1
                    now = time.monotonic()
                    if n_out > 1:
                        self.metrics.inter_token(now - last)
                    elif index == 0:
                        self.metrics.first_token(now - job.submitted)
                    self.metrics.tokens(1)
                    last = now
                    if event.logprob is not None:
                        lp = entry(event.token_id, event.logprob, event.top)
                job.emit((index, event, lp))
                if isinstance(event, FinishEvent):
                    return event.reason != "cancelled"
                if job.cancel.is_set():
                    return False
                if deadline is not None and time.monotonic() > deadline:
                    logger.info("job %d: generation time limit reached", job.id)
                    job.emit((index, FinishEvent("length", n_prompt, n_out), None))
                    return True
        except ContextOverflowError as exc:
            raise APIError(
                400,
                f"{call.prompt_param}: {exc}",
                param=call.prompt_param,
                code="context_length_exceeded",
            ) from None
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
        return True

    # -- running a call ---------------------------------------------------------------------

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                logger.debug("client of job %d disconnected", job.id)
                self.scheduler.cancel(job)
                job.put_local(_GONE)
                return

    def _failure(self, failed: JobFailed) -> APIError:
        exc = failed.exc
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ContextOverflowError):
            return APIError(400, str(exc), code="context_length_exceeded")
        if isinstance(exc, SparseInferError):
            return APIError(400, str(exc))
        logger.error("generation failed", exc_info=exc)
        return APIError(
            500,
            f"internal error during generation: {type(exc).__name__}: {exc}",
            type="server_error",
            code="internal_error",
        )

    def _submit(self, work: Callable[[Job], None]) -> Job:
        job = Job(work, asyncio.get_running_loop())
        try:
            ahead = self.scheduler.submit(job)
        except QueueFullError as exc:
            raise APIError(
                429,
                f"the server is busy: {exc}; retry later",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None
        logger.debug("job %d queued behind %d", job.id, ahead)
        return job

    async def first_event(self, job: Job) -> Any:
        """The job's first event (``_GONE``: the client went away); its failure raised as an
        ``APIError``, a shutdown before it ran as a 503."""
        first = await job.get()
        if isinstance(first, JobFailed):
            raise self._failure(first)
        if first is END:  # cancelled without running: the server is shutting down
            raise APIError(503, "the server is shutting down", type="server_error")
        return first

    async def one_result(self, request: Request, work: Callable[[Job], None]) -> Any:
        """Run ``work`` as a job on the queue: the one item it emits (None if the client went
        away first)."""
        job = self._submit(work)
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            item = await self.first_event(job)
            return None if item is _GONE else item
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)

    def grammar_processors(self, grammar: Any, param: str) -> Callable[[], list[Any]] | None:
        """A factory of a fresh grammar processor per generation (None without a grammar); a
        400 blaming ``param`` when the engine takes no logits processors."""
        if grammar is None:
            return None
        if not self._supports("processors"):
            raise APIError(400, f"{param}: this engine has no logits processors", param=param)
        vocab = getattr(self.engine, "vocab_size", None) or 0
        return lambda: [GrammarProcessor(grammar, vocab)]

    async def start(self, request: Request, call: _Call) -> tuple[Job, Any, asyncio.Task[None]]:
        """``call`` queued as a job: (the job, its first event, the task watching the client);
        a failure before the first event (a bad prompt, a full queue) raised as its APIError.
        The routes of other APIs (Ollama's, Responses, Anthropic's) spell the events."""
        job = self._submit(self._work(call))
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            return job, await self.first_event(job), watcher
        except APIError:
            watcher.cancel()
            self.scheduler.cancel(job)
            raise

    async def spelled(self, request: Request, call: _Call, answer: Any) -> Response:
        """``call`` run and answered as ``answer`` spells it — another API's events (Responses,
        Anthropic's): ``begin()`` (the stream's first events), ``thought(text)``,
        ``token(event)`` and ``end(finish)`` (each a list of SSE events; ``end`` sets
        ``answer.finish``), ``error(exc)`` (the event of a failure) and ``whole()`` (the body
        without a stream). Streamed with ``call.stream``; else the events run unsent and the
        body is answered, or the failure raised."""
        job, first, watcher = await self.start(request, call)
        events = self._spell(job, first, watcher, answer)
        if call.stream:
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        async for _ in events:
            pass
        if answer.failed is not None:
            raise answer.failed
        if answer.finish is None:  # the client went away
            return Response(status_code=499)
        return JSONResponse(answer.whole())

    async def _spell(self, job: Job, item: Any, watcher: asyncio.Task[None],
                     answer: Any) -> AsyncIterator[str]:
        try:
            for out in answer.begin():
                yield out
            while item is not END:
                if isinstance(item, JobFailed):
                    answer.failed = self._failure(item)
                    yield answer.error(answer.failed)
                    return
                if item is _GONE:
                    return
                _, event, _ = item
                if isinstance(event, Thought):
                    outs = answer.thought(event.text)
                elif isinstance(event, TokenEvent):
                    outs = answer.token(event)
                elif isinstance(event, FinishEvent):
                    if event.reason == "cancelled":
                        return
                    outs = answer.end(event)
                else:
                    outs = []
                for out in outs:
                    yield out
                item = await job.get()
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)

    async def run(self, request: Request, call: _Call) -> Response:
        job = self._submit(self._work(call))
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        handed_off = False
        try:
            first = await self.first_event(job)
            if first is _GONE:
                return Response(status_code=499)
            rid = ("chatcmpl-" if call.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
            if call.stream:
                handed_off = True
                return StreamingResponse(
                    self._sse(call, job, first, watcher, rid),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
            return await self._collect(call, job, first, rid)
        finally:
            if not handed_off:
                watcher.cancel()
                self.scheduler.cancel(job)

    async def _collect(self, call: _Call, job: Job, item: Any, rid: str) -> Response:
        got = _Choices(call.n_choices)
        while item is not END:
            if isinstance(item, JobFailed):
                raise self._failure(item)
            if item is _GONE:
                return Response(status_code=499)
            index, event, lp = item
            if isinstance(event, FinishEvent) and event.reason == "cancelled":
                raise APIError(
                    503, "generation was cancelled (server shutting down)", type="server_error"
                )
            got.add(index, event, lp)
            item = await job.get()
        if any(f is None for f in got.finish):
            raise APIError(500, "generation ended without a finish event", type="server_error")
        usage = _usage(got.finish, call.n)
        created = int(time.time())
        body: BaseModel
        if call.kind == "chat":
            choices = []
            for i in range(call.n_choices):
                reason = got.finish[i].reason  # type: ignore[union-attr]
                text = got.text[i]
                tools = _parse_tool_calls(text, call.tools, call.several) if call.tools else None
                thinking = got.thinking[i]
                message = (
                    AssistantMessage(content=None, tool_calls=tools, reasoning_content=thinking)
                    if tools is not None
                    else AssistantMessage(content=text, reasoning_content=thinking)
                )
                choices.append(
                    ChatChoice(
                        index=i,
                        message=message,
                        logprobs=_chat_logprobs(got.logprobs[i])
                        if call.logprobs is not None
                        else None,
                        finish_reason="tool_calls" if tools is not None else reason,
                    )
                )
            body = ChatCompletion(
                id=rid, created=created, model=self.model_name, usage=usage, choices=choices
            )
        else:
            choices_t = []
            for i in range(call.n_choices):
                echo = got.echo[i]
                lead = echo.text if echo is not None else ""
                logprobs = None
                if call.logprobs is not None:
                    entries = list(echo.logprobs if echo is not None else ()) + got.logprobs[i]
                    logprobs = _completion_logprobs(entries)
                choices_t.append(
                    CompletionChoice(
                        index=i,
                        text=lead + got.text[i],
                        logprobs=logprobs,
                        finish_reason=got.finish[i].reason,  # type: ignore[union-attr]
                    )
                )
            body = Completion(
                id=rid, created=created, model=self.model_name, usage=usage, choices=choices_t
            )
        return Response(body.model_dump_json(exclude_none=False), media_type="application/json")

    def _chunk(self, call: _Call, rid: str, created: int, choice: Any = None,
               usage: Usage | None = None) -> str:
        """One SSE ``data:`` line holding ``choice`` (or none, for the usage chunk)."""
        chunk: BaseModel
        choices = [] if choice is None else [choice]
        if call.kind == "chat":
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
        else:
            chunk = Completion(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
        return f"data: {chunk.model_dump_json()}\n\n"

    async def _sse(
        self, call: _Call, job: Job, item: Any, watcher: asyncio.Task[None], rid: str
    ) -> AsyncIterator[str]:
        created = int(time.time())
        chat = call.kind == "chat"
        started: set[int] = set()
        held = [""] * call.n_choices  # tool-call answers are sent whole, once complete
        finishes: list[FinishEvent | None] = [None] * call.n_choices
        try:
            while True:
                if isinstance(item, JobFailed):
                    yield f"data: {self._failure(item).body().model_dump_json()}\n\n"
                    return
                if item is _GONE:
                    return
                if item is END:
                    break
                index, event, lp = item
                if chat and index not in started:
                    started.add(index)
                    delta = ChatDelta(role="assistant", content="")
                    yield self._chunk(call, rid, created, ChatChunkChoice(index=index, delta=delta))
                if isinstance(event, Thought):
                    delta = ChatDelta(reasoning_content=event.text)
                    yield self._chunk(call, rid, created, ChatChunkChoice(index=index, delta=delta))
                elif isinstance(event, _Echo):
                    logprobs = _completion_logprobs(list(event.logprobs)) if event.logprobs else None
                    choice = CompletionChoice(index=index, text=event.text, logprobs=logprobs)
                    yield self._chunk(call, rid, created, choice)
                elif isinstance(event, TokenEvent):
                    if call.tools:
                        held[index] += event.text
                    elif event.text or lp is not None:
                        if chat:
                            choice = ChatChunkChoice(
                                index=index,
                                delta=ChatDelta(content=event.text),
                                logprobs=_chat_logprobs([lp]) if lp is not None else None,
                            )
                        else:
                            logprobs = _completion_logprobs([lp]) if lp is not None else None
                            choice = CompletionChoice(
                                index=index, text=event.text, logprobs=logprobs
                            )
                        yield self._chunk(call, rid, created, choice)
                elif isinstance(event, FinishEvent):
                    if event.reason == "cancelled":
                        return
                    finishes[index] = event
                    reason: str = event.reason
                    if call.tools:
                        tools = _parse_tool_calls(held[index], call.tools, call.several)
                        if tools is None:
                            deltas = [ChatDelta(content=held[index])]
                        else:  # one chunk per call, as OpenAI streams them
                            reason = "tool_calls"
                            deltas = [
                                ChatDelta(tool_calls=[ToolCallDelta(
                                    index=i, id=tool.id, type="function",
                                    function=FunctionCallDelta(name=tool.function.name,
                                                               arguments=tool.function.arguments),
                                )])
                                for i, tool in enumerate(tools)
                            ]
                        for delta in deltas:
                            yield self._chunk(
                                call, rid, created, ChatChunkChoice(index=index, delta=delta)
                            )
                    if chat:
                        choice = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)
                    else:
                        choice = CompletionChoice(index=index, text="", finish_reason=reason)
                    yield self._chunk(call, rid, created, choice)
                item = await job.get()
            if any(f is None for f in finishes):
                return  # cut short (shutdown): no [DONE], the client sees an incomplete stream
            if call.include_usage:
                yield self._chunk(call, rid, created, usage=_usage(finishes, call.n))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)

    # -- handlers ---------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        self.check_common(req)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        grammar = None
        tools: tuple[str, ...] = ()
        several = False
        fmt = req.response_format
        if req.tools and req.tool_choice != "none":
            tools = tuple(t.function.name for t in req.tools)
            named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
            chosen = [t for t in req.tools if named is None or t.function.name == named]
            mode = "auto" if req.tool_choice in (None, "auto") else "required"
            # several calls in one answer unless turned off or one named tool is forced
            several = named is None and req.parallel_tool_calls is not False
            specs = [(t.function.name, t.function.parameters) for t in chosen]
            grammar = self._compile(lambda g: g.tool_calls(specs, mode, several), "tools")
            with_system_text(messages, _tool_prompt(chosen, req.tool_choice, several))
        elif fmt is not None and fmt.type == "json_object":
            grammar = self._compile(lambda g: g.json_schema(None), "response_format")
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            grammar = self._compile(lambda g: g.json_schema(schema), "response_format.json_schema")
        want_lp = bool(req.logprobs)
        if want_lp and not self._supports("logprobs"):
            raise APIError(400, "logprobs: this engine does not report logprobs", param="logprobs")
        template_kwargs = self.template_kwargs(req.chat_template_kwargs)
        call = _Call(
            kind="chat",
            prompts=[lambda: self._chat_ids(messages, template_kwargs)],
            prompt_param="messages",
            params=_sampling(req, self.limits.max_tokens(req.token_limit, "max_tokens")),
            stream=req.stream,
            include_usage=req.include_usage,
            n=req.n,
            logprobs=(req.top_logprobs or 0) if want_lp else None,
            processors=self._processors(req, grammar),
            tools=tools,
            several=several,
            # a constrained answer (JSON, tool calls) starts at its first token: no thoughts
            thoughts=self.thoughts(req.reasoning_format) if grammar is None else None,
        )
        return await self.run(request, call)

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        self.check_common(req)
        prompts = req.prompts()
        if req.logprobs is not None and not self._supports("logprobs"):
            raise APIError(400, "logprobs: this engine does not report logprobs", param="logprobs")
        if req.echo and req.logprobs is not None and not hasattr(self.engine, "score"):
            raise APIError(400, "echo: this engine cannot score prompts", param="echo")
        call = _Call(
            kind="text",
            prompts=[(lambda p=p: self._text_ids(p)) for p in prompts],
            prompt_param="prompt",
            params=_sampling(req, self.limits.max_tokens(req.token_limit, "max_tokens")),
            stream=req.stream,
            include_usage=req.include_usage,
            n=req.n,
            echo=req.echo,
            echo_texts=tuple(p if isinstance(p, str) else None for p in prompts),
            logprobs=req.logprobs,
            processors=self._processors(req),
        )
        return await self.run(request, call)

    async def embeddings(self, request: Request) -> Response:
        req: EmbeddingRequest = await self.parse(request, EmbeddingRequest)
        self.check_common(req)
        if not callable(getattr(self.engine, "embed", None)):
            raise APIError(400, "input: this engine does not compute embeddings", param="input")
        texts = req.texts()
        engine, pooling, n_ctx = self.engine, self.pooling, self.engine.n_ctx

        def work(job: Job) -> None:
            ids = [self._text_ids(t, "input") for t in texts]  # every text checked first
            for i, one in enumerate(ids):
                if len(one) > n_ctx:
                    raise APIError(
                        400,
                        f"input{f'[{i}]' if len(ids) > 1 else ''}: this model's maximum context "
                        f"length is {n_ctx} tokens but the input has {len(one)} tokens",
                        param="input",
                        code="context_length_exceeded",
                    )
            out = []
            for one in ids:
                if job.cancel.is_set():
                    return
                out.append(engine.embed(one, pooling))
            job.emit((out, sum(len(one) for one in ids)))

        item = await self.one_result(request, work)
        if item is None:
            return Response(status_code=499)
        vectors, n_tokens = item
        data = [
            Embedding(index=i, embedding=_base64_floats(v) if req.encoding_format == "base64"
                      else v)
            for i, v in enumerate(vectors)
        ]
        body = EmbeddingList(data=data, model=self.model_name,
                             usage=EmbeddingUsage(prompt_tokens=n_tokens, total_tokens=n_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created)

    def health(self) -> Health:
        return Health(
            model=self.model_name,
            running=self.scheduler.running,
            queued=self.scheduler.queued,
            max_queue=self.scheduler.max_queue,
        )


class _CountRequests:
    """ASGI middleware counting answered requests by route and status for /metrics (plain ASGI:
    streamed bodies and disconnects pass through untouched)."""

    _ROUTES = frozenset(
        {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
         "/v1/embeddings"}
    )

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 499  # no response started: the client went away

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            route = path if path in self._ROUTES else (
                "/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            self.metrics.request(route, status)


def _base64_floats(values: list[float]) -> str:
    """OpenAI's base64 embedding: the float32 values, little-endian, base64-encoded."""
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=exc.headers)


_ERRORS = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "the queue is full (see Retry-After)",
    500: "internal error",
    503: "the server is shutting down",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The app's schema with the request bodies the routes read themselves (from the pydantic
    models) and without FastAPI's 422, which this server never sends (it answers 400)."""
    from fastapi.openapi.utils import get_openapi

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: type[BaseModel]) -> dict[str, str]:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        for path, model in (
            ("/v1/chat/completions", ChatCompletionRequest),
            ("/v1/completions", CompletionRequest),
            ("/v1/embeddings", EmbeddingRequest),
        ):
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref(model)}},
            }
        for item in schema["paths"].values():
            for op in item.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in (ChatCompletionChunk, Completion, ErrorResponse):  # named by the SSE events
            if model.__name__ not in components:
                js = model.model_json_schema(
                    ref_template="#/components/schemas/{model}", mode="serialization"
                )
                components.update({k: v for k, v in js.pop("$defs", {}).items()
                                   if k not in components})
                components[model.__name__] = js
        app.openapi_schema = schema
        return schema

    return build


def create_app(
    engine: EngineProtocol,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body_bytes: int = 1 << 20,
    default_max_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    max_generation_seconds: float | None = None,
    pooling: str = "mean",
    reasoning_format: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``. Its worker thread runs while the app's lifespan does.

    ``default_max_tokens``: the budget of a request that names none (None: until end of text or
    the context is full); ``max_tokens_limit``: a request asking for more is a 400;
    ``max_generation_seconds``: a generation running longer ends with finish_reason "length";
    ``pooling``: how ``/v1/embeddings`` makes one vector of a text (``generate.POOLINGS``);
    ``reasoning_format``: "auto" (a thinking model's thoughts apart from its answer) or "none"
    (left in it); ``chat_template_kwargs``: variables every chat template rendering gets
    (a request's own take precedence).
    """
    server = OpenAIServer(
        engine,
        model_name=model_name,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        limits=_Limits(default_max_tokens, max_tokens_limit, max_generation_seconds),
        pooling=pooling,
        reasoning_format=reasoning_format,
        chat_template_kwargs=chat_template_kwargs,
    )
    server.metrics.watch(lambda: server.scheduler.queued, lambda: server.scheduler.running)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.scheduler.close)

    app = FastAPI(title="sparseinfer", lifespan=lifespan)
    app.state.server = server
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning(
                "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message
            )
        if request.url.path.startswith("/v1/messages"):  # Anthropic's shape (a key refused)
            from .anthropic import error_body

            return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
        return _error_response(exc)

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        err = APIError(exc.status_code, message, code=codes.get(exc.status_code))
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return _error_response(APIError(400, f"{loc}: {first.get('msg')}", param=loc or None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        err = APIError(
            500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"
        )
        return _error_response(err)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:  # the chat page (server/webui/index.html)
        return HTMLResponse(index_html())

    @app.get("/health")
    async def health() -> Health:
        return server.health()

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    auth = [Depends(server.check_auth)]

    @app.get("/v1/models", dependencies=auth, responses=_errors(401))
    async def list_models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=_errors(401, 404))
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in (server.model_name, engine.name):
            raise APIError(
                404,
                f"model: the model {model_id!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return server.model_card()

    def generation(answer: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
        # each SSE event (OpenAPI < 3.2: ``schema`` describes one event): data is a chunk, an
        # error object, or the final "[DONE]"
        json_data = {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "anyOf": [
                    {"$ref": f"#/components/schemas/{chunk.__name__}"},
                    {"$ref": "#/components/schemas/ErrorResponse"},
                ]
            },
        }
        event = {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        }
        stream = {"schema": event}
        return {
            200: {
                "model": answer,
                "description": f"{answer.__name__}, or with stream: true SSE events",
                "content": {"text/event-stream": stream},
            },
            **_errors(400, 401, 404, 413, 429, 500, 503),
        }

    @app.post(
        "/v1/chat/completions",
        dependencies=auth,
        response_class=Response,
        responses=generation(ChatCompletion, ChatCompletionChunk),
    )
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.post(
        "/v1/completions",
        dependencies=auth,
        response_class=Response,
        responses=generation(Completion, Completion),
    )
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post(
        "/v1/embeddings",
        dependencies=auth,
        response_model=EmbeddingList,
        responses=_errors(400, 401, 404, 413, 429, 500, 503),
    )
    async def embeddings(request: Request) -> Response:
        return await server.embeddings(request)

    from .ollama import add_routes

    add_routes(app, server, auth)  # Ollama's own API, /api/*
    from .responses import add_routes as add_responses

    add_responses(app, server, auth)  # OpenAI's Responses API, /v1/responses
    from .anthropic import add_routes as add_anthropic

    add_anthropic(app, server, auth)  # Anthropic's Messages API, /v1/messages
    return app


# -- running the server ---------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it Nagle + delayed ACKs hold each streamed token back by ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening from here on: a client that connects before uvicorn's loop runs waits in
        # the backlog instead of being refused
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server that sets ``ready`` (and logs ``announce``) once it accepts connections."""

    def __init__(
        self, config: uvicorn.Config, ready: threading.Event | None, announce: str | None = None
    ) -> None:
        super().__init__(config)
        self.ready = ready
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            if self.announce:
                logger.info("%s", self.announce)
            if self.ready is not None:
                self.ready.set()


def _config(app: FastAPI, log_level: str, **uvicorn_kw: Any) -> uvicorn.Config:
    uvicorn_kw.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Config(app, log_level=log_level, lifespan="on", **uvicorn_kw)


def serve(
    engine: EngineProtocol,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_queue: int = 16,
    ready: threading.Event | None = None,
    *,
    model_name: str | None = None,
    max_body_bytes: int = 1 << 20,
    default_max_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    max_generation_seconds: float | None = None,
    pooling: str = "mean",
    reasoning_format: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    log_level: str = "info",
    **uvicorn_kw: Any,
) -> None:
    """Serve ``engine`` over HTTP until interrupted (Ctrl-C / SIGTERM). Blocks.

    ``ready`` is set once connections are accepted. Extra keywords go to ``uvicorn.Config``.
    """
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without an API key: anyone who can reach it may use it", host)
    app = create_app(
        engine,
        model_name=model_name,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_generation_seconds=max_generation_seconds,
        pooling=pooling,
        reasoning_format=reasoning_format,
        chat_template_kwargs=chat_template_kwargs,
    )
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    announce = f"serving {app.state.server.model_name} on http://{host}:{bound}/v1"
    server = _Uvicorn(_config(app, log_level, **uvicorn_kw), ready, announce)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """Runs an app under uvicorn in a background thread, on a socket bound before it starts (so
    ``port=0`` picks a free port and ``.port`` is known at once). For tests and benchmarks::

        with ServerThread(create_app(engine)) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none")
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        **uvicorn_kw: Any,
    ) -> None:
        self.app = app
        self.host = host
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._ready = threading.Event()
        self._server = _Uvicorn(_config(app, log_level, **uvicorn_kw), self._ready)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except SystemExit:  # uvicorn exits on a failed startup
            logger.error("server on port %d failed to start", self.port)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on {self.url} did not start within {timeout} s")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
