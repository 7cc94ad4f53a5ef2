"""Ollama's own HTTP API (``/api/*``) beside the OpenAI routes, over the same engine and queue,
so tools written for Ollama can point at ``sparseinfer serve --port 11434`` (tested through
Ollama's Python client; README says what else was tried).

Routes: ``GET /api/tags``, ``/api/ps``, ``/api/version``; ``POST /api/show``, ``/api/chat``,
``/api/generate``, ``/api/embed`` and the older ``/api/embeddings``.

As Ollama does:
- ``stream`` is on unless a request sets it false; a stream is NDJSON (one JSON object a line)
  and its last object has ``done: true``, ``done_reason`` ("stop" / "length") and the counts and
  durations (nanoseconds); without a stream that last object carries the whole answer.
- ``model`` must name the served model (``NAME`` or ``NAME:latest``); another is a 404.
- ``/api/generate`` puts ``prompt`` (and ``system``) through the model's chat template unless
  ``raw``; ``context`` (the ids a previous answer returned) goes in front, and the answer returns
  the new ``context``. An empty prompt (or chat without messages) only answers ``done_reason:
  "load"``: the model is loaded already.
- ``options``: temperature, top_k, top_p, min_p, seed, num_predict (-1 until the end, -2 until
  the context is full), stop, repeat_penalty, repeat_last_n, presence_penalty,
  frequency_penalty; other options Ollama takes (num_ctx, num_thread, mirostat, ...) are ignored
  and logged, as Ollama ignores ones it does not know. Unset ones keep ``SamplingParams``'
  defaults (llama.cpp's), not a Modelfile's.
- ``format``: ``"json"`` or a JSON schema, by constrained decoding (as ``response_format``);
  ``tools`` as on ``/v1/chat/completions``, answered as ``message.tool_calls`` with arguments as
  objects.
- ``think``: a thinking model's thoughts (its template names ``<think>``: DeepSeek-R1, QwQ,
  Qwen3) come as ``message.thinking`` / ``thinking`` apart from the answer (unless the answer is
  constrained by ``format`` or ``tools``, or ``raw``); ``think: true`` / ``false`` sets the
  template's ``enable_thinking`` (Qwen3's switch), unset keeps the model's default.
  ``think: true`` on another model, and levels ("low" / "high"), are 400s.
- Errors are ``{"error": "..."}`` with a 4xx/5xx status. ``images``, ``suffix`` and ``template``
  are 400s naming the field (this server has no such model).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..config import SamplingParams
from ..engine import FinishEvent, TokenEvent
from .protocol import APIError, Tool, validation_error
from .queue import END, JobFailed
from .app import Thought

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
# Ollama's options this server maps onto SamplingParams (name -> SamplingParams field)
SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                    "min_p": "min_p", "repeat_penalty": "repeat_penalty",
                    "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty"}
INTEGER_OPTIONS = {"top_k", "repeat_last_n"}


# -- requests (lenient about fields Ollama's clients send and this server need not read) --------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    keep_alive: float | str | None = None  # accepted: the model stays loaded


class _Generating(_Request):
    stream: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: bool | str | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None

    def text(self) -> str:
        """The content, with an assistant turn's tool calls spelled as the model wrote them."""
        calls = [json.dumps({"name": c.get("function", {}).get("name"),
                             "arguments": c.get("function", {}).get("arguments", {})})
                 for c in self.tool_calls or ()]
        if len(calls) > 1:
            return self.content + "[" + ", ".join(calls) + "]"
        return self.content + "".join(calls)


class ChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None


class EmbedRequest(_Request):
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] = Field(default_factory=dict)
    dimensions: int | None = None


class EmbeddingsRequest(_Request):
    prompt: str = ""
    options: dict[str, Any] = Field(default_factory=dict)


class ShowRequest(_Request):
    name: str | None = None  # the older spelling of ``model``


# -- helpers -------------------------------------------------------------------------------------


def _now() -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class OllamaAPI:
    """The ``/api/*`` routes' logic over an ``app.OpenAIServer`` (its queue, prompt building,
    grammars and limits)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.engine = server.engine
        self.started = _now()

    # -- request checks ---------------------------------------------------------------------

    @property
    def tag(self) -> str:
        name = self.server.model_name
        return name if ":" in name else f"{name}:latest"

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = await self.server.read_body(request)
        try:
            req = model.model_validate_json(body or b"{}")
        except ValidationError as exc:
            raise validation_error(exc) from None
        return req

    def check_model(self, name: str) -> None:
        if not name:
            raise APIError(400, "model is required", param="model")
        if name not in (self.tag, self.server.model_name, self.engine.name):
            raise APIError(404, f"model '{name}' not found; this server serves '{self.tag}'",
                           param="model")

    def sampling(self, options: dict[str, Any]) -> SamplingParams:
        kw: dict[str, Any] = {}
        ignored = []
        for key, value in options.items():
            if key in SAMPLING_OPTIONS:
                whole = key in INTEGER_OPTIONS
                if (isinstance(value, bool) or not isinstance(value, (int, float))
                        or (whole and value != int(value))):
                    want = "an integer" if whole else "a number"
                    raise APIError(400, f"options.{key}: expected {want}, got {value!r}",
                                   param=f"options.{key}")
                kw[SAMPLING_OPTIONS[key]] = int(value) if whole else float(value)
            elif key == "seed":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise APIError(400, f"options.seed: expected an integer, got {value!r}",
                                   param="options.seed")
                kw["seed"] = value % (1 << 63)
            elif key == "stop":
                stops = [value] if isinstance(value, str) else value
                if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                    raise APIError(400, f"options.stop: expected strings, got {value!r}",
                                   param="options.stop")
                kw["stop"] = tuple(s for s in stops if s)
            elif key != "num_predict":
                ignored.append(key)
        if ignored:
            logger.info("Ollama options not used by this server: %s", ", ".join(sorted(ignored)))
        n = options.get("num_predict")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < -2):
            raise APIError(400, f"options.num_predict: expected an integer >= -2, got {n!r}",
                           param="options.num_predict")
        limits = self.server.limits
        if n is not None and n < 0:  # asked for no bound: the server's own limit, if it has one
            kw["max_tokens"] = limits.max_tokens_limit or -1
        else:  # unset: the server's default budget
            kw["max_tokens"] = limits.max_tokens(n, "options.num_predict")
        if kw.get("temperature", 1.0) < 0:
            raise APIError(400, "options.temperature: expected >= 0", param="options.temperature")
        return SamplingParams(**kw)

    def grammar(self, req: _Generating) -> Any:
        if req.format == "json":
            return self.server._compile(lambda g: g.json_schema(None), "format")
        if isinstance(req.format, dict):
            schema = req.format
            return self.server._compile(lambda g: g.json_schema(schema), "format")
        return None

    def think(self, req: _Generating) -> dict[str, Any] | None:
        """The chat template's variables for ``think``: a thinking model's ``enable_thinking``
        (true / false), nothing when unset (the model's default); a 400 for ``think: true`` on a
        model that does not think, and for levels ("low" / "high": gpt-oss's)."""
        think = {"true": True, "false": False, "": None}.get(req.think, req.think) if isinstance(
            req.think, str) else req.think
        if think is None:
            return None
        if not isinstance(think, bool):
            raise APIError(400, f"think: this model takes true or false, got {req.think!r}",
                           param="think")
        if getattr(self.engine, "think_tags", None) is None:
            if think:
                raise APIError(400, "think: this model does not support thinking", param="think")
            return None
        return self.server.template_kwargs({"enable_thinking": think}, "think")

    # -- routes ---------------------------------------------------------------------------------

    def model_entry(self) -> dict[str, Any]:
        return {"name": self.tag, "model": self.tag, "modified_at": self.started,
                "size": int(self.described().get("file_bytes", 0)), "digest": "",
                "details": self.details()}

    def described(self) -> dict[str, Any]:
        """The engine's ``details()``, where it has them (a test's fake may not)."""
        info = getattr(self.engine, "details", None)
        return info() if callable(info) else {}

    def details(self) -> dict[str, Any]:
        d = self.described()
        family = d.get("family", "")
        return {"parent_model": "", "format": d.get("format", "gguf"), "family": family,
                "families": [family] if family else None,
                "parameter_size": d.get("parameter_size", ""),
                "quantization_level": d.get("quantization_level", "")}

    def show(self) -> dict[str, Any]:
        d = self.described()
        caps = ["completion"] + (["embedding"] if callable(getattr(self.engine, "embed", None))
                                 else [])
        if getattr(self.engine, "think_tags", None) is not None:
            caps.append("thinking")
        family = d.get("family", "")
        model_info: dict[str, Any] = {}
        if family:  # llama.cpp's GGUF keys, as Ollama shows them
            model_info = {"general.architecture": family,
                          f"{family}.context_length": self.engine.n_ctx}
            if "embedding_length" in d:
                model_info[f"{family}.embedding_length"] = d["embedding_length"]
        return {"modelfile": "", "parameters": "", "template": "",
                "details": self.details(), "model_info": model_info, "capabilities": caps,
                "modified_at": self.started}

    async def chat(self, request: Request) -> Response:
        req: ChatRequest = await self.parse(request, ChatRequest)
        self.check_model(req.model)
        template_kwargs = self.think(req)
        if not req.messages:
            return self.loaded(req.stream, {"message": {"role": "assistant", "content": ""}})
        for i, m in enumerate(req.messages):
            if m.images:
                raise APIError(400, f"messages[{i}].images: this model does not take images",
                               param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        params = self.sampling(req.options)
        grammar, names = self.grammar(req), ()
        if req.tools:
            from .app import _tool_prompt, with_system_text

            names = tuple(t.function.name for t in req.tools)
            specs = [(t.function.name, t.function.parameters) for t in req.tools]
            grammar = self.server._compile(lambda g: g.tool_calls(specs, "auto", True), "tools")
            with_system_text(messages, _tool_prompt(req.tools, None, True))
        prompt = lambda: self.server._chat_ids(messages, template_kwargs)  # noqa: E731 (worker)
        return await self.generate_with(request, prompt, params, grammar, req.stream,
                                        _ChatShape(names))

    async def generate(self, request: Request) -> Response:
        req: GenerateRequest = await self.parse(request, GenerateRequest)
        self.check_model(req.model)
        template_kwargs = self.think(req)
        for field in ("images", "suffix", "template"):
            if getattr(req, field):
                raise APIError(400, f"{field}: not supported by this server", param=field)
        if not req.prompt:
            return self.loaded(req.stream, {"response": ""})
        params = self.sampling(req.options)
        context = list(req.context or ())
        shape = _GenerateShape()

        def prompt() -> list[int]:  # on the worker, before any event
            if req.raw:
                ids = self.server._text_ids(req.prompt)
            else:
                turn = ([{"role": "system", "content": req.system}] if req.system else []) + [
                    {"role": "user", "content": req.prompt}]
                ids = self.server._chat_ids(turn, template_kwargs)
            shape.prompt = context + ids
            return shape.prompt

        return await self.generate_with(request, prompt, params, self.grammar(req), req.stream,
                                        shape, raw=req.raw)

    def loaded(self, stream: bool, fields: dict[str, Any]) -> Response:
        body = {"model": self.tag, "created_at": _now(), **fields, "done": True,
                "done_reason": "load"}
        if stream:
            return Response(json.dumps(body) + "\n", media_type=NDJSON)
        return JSONResponse(body)

    async def embed(self, request: Request, legacy: bool = False) -> Response:
        req = await self.parse(request, EmbeddingsRequest if legacy else EmbedRequest)
        self.check_model(req.model)
        if not callable(getattr(self.engine, "embed", None)):
            raise APIError(400, "this model does not compute embeddings", param="input")
        if legacy:
            texts = [req.prompt]
        else:
            if getattr(req, "dimensions", None) is not None:
                raise APIError(400, "dimensions: not supported by this server",
                               param="dimensions")
            texts = [req.input] if isinstance(req.input, str) else list(req.input)
            if not texts or any(not t for t in texts):
                raise APIError(400, "input: expected a non-empty string or strings", param="input")
        truncate = getattr(req, "truncate", True)
        server, n_ctx, t0 = self.server, self.engine.n_ctx, time.monotonic()

        def work(job: Any) -> None:
            out, used = [], 0
            for t in texts:
                if job.cancel.is_set():
                    return
                ids = server._text_ids(t, "input")
                if len(ids) > n_ctx:
                    if not truncate:
                        raise APIError(400, f"input: the input has {len(ids)} tokens, more "
                                       f"than the context length {n_ctx}", param="input")
                    ids = ids[:n_ctx]
                used += len(ids)
                out.append(self.engine.embed(ids, server.pooling))
            job.emit((out, used))

        result = await self.server.one_result(request, work)
        if result is None:
            return Response(status_code=499)
        vectors, used = result
        if legacy:
            return JSONResponse({"embedding": vectors[0]})
        return JSONResponse({"model": self.tag, "embeddings": vectors,
                             "total_duration": _ns(time.monotonic() - t0), "load_duration": 0,
                             "prompt_eval_count": used})

    # -- running ----------------------------------------------------------------------------

    async def generate_with(self, request: Request, prompt: Callable[[], list[int]],
                            params: SamplingParams, grammar: Any, stream: bool,
                            shape: _Shape, raw: bool = False) -> Response:
        """Generate from ``prompt`` and answer in ``shape``; a thinking model's thoughts apart
        (Ollama's ``thinking``) unless constrained by ``grammar`` or ``raw``."""
        from .app import _Call

        call = _Call(kind="chat", prompts=[prompt], prompt_param="messages" if isinstance(
            shape, _ChatShape) else "prompt", params=params, stream=stream,
            include_usage=False, processors=self.server.grammar_processors(grammar, "format"),
            thoughts=self.server.thoughts(None) if grammar is None and not raw else None)
        t0 = time.monotonic()
        job, first, watcher = await self.server.start(request, call)
        lines = self.lines(job, first, watcher, shape, t0)
        if stream:
            return StreamingResponse(lines, media_type=NDJSON)
        last: dict[str, Any] = {}
        async for line in lines:
            last = json.loads(line)
            if "error" in last:
                return JSONResponse(last, status_code=500)
        if not last.get("done"):
            return Response(status_code=499)
        return JSONResponse(shape.whole(last))

    async def lines(self, job: Any, item: Any, watcher: asyncio.Task[None], shape: _Shape,
                    t0: float) -> AsyncIterator[str]:
        server = self.server
        try:
            while item is not END:
                if isinstance(item, JobFailed):
                    yield json.dumps({"error": server._failure(item).message}) + "\n"
                    return
                if not isinstance(item, tuple):  # the client went away
                    return
                _, event, _ = item
                if isinstance(event, Thought):
                    yield self.line(shape.thought(event.text), done=False)
                elif isinstance(event, TokenEvent):
                    fields = shape.token(event)
                    if fields is not None:
                        yield self.line(fields, done=False)
                elif isinstance(event, FinishEvent):
                    if event.reason == "cancelled":
                        return
                    for fields in shape.end():
                        yield self.line(fields, done=False)
                    stats = {"done_reason": event.reason,
                             "total_duration": _ns(time.monotonic() - t0), "load_duration": 0,
                             "prompt_eval_count": event.prompt_tokens,
                             "prompt_eval_duration": _ns(event.prefill_seconds),
                             "eval_count": event.completion_tokens,
                             "eval_duration": _ns(event.decode_seconds)}
                    yield self.line({**shape.final(), **stats}, done=True)
                item = await job.get()
        finally:
            watcher.cancel()
            server.scheduler.cancel(job)

    def line(self, fields: dict[str, Any], done: bool) -> str:
        return json.dumps({"model": self.tag, "created_at": _now(), **fields, "done": done}) + "\n"


# -- how each route spells its answer ------------------------------------------------------------


class _Shape:
    """A route's answer: the fields of each token's line, of lines at the end (before the last),
    of the last line, and the whole answer without a stream from the lines streamed."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thinking: list[str] = []

    def token(self, event: TokenEvent) -> dict[str, Any] | None:
        raise NotImplementedError

    def thought(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def end(self) -> list[dict[str, Any]]:
        return []

    def final(self) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, last: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class _ChatShape(_Shape):
    def __init__(self, tools: tuple[str, ...]) -> None:
        super().__init__()
        self.tools = tools
        self.calls: list[dict[str, Any]] | None = None

    def token(self, event: TokenEvent) -> dict[str, Any] | None:
        self.text.append(event.text)
        if self.tools or not event.text:  # a tool call is answered whole, at the end
            return None
        return {"message": {"role": "assistant", "content": event.text}}

    def thought(self, text: str) -> dict[str, Any]:
        self.thinking.append(text)
        return {"message": {"role": "assistant", "content": "", "thinking": text}}

    def end(self) -> list[dict[str, Any]]:
        if not self.tools:
            return []
        from .app import _parse_tool_calls

        text = "".join(self.text)
        parsed = _parse_tool_calls(text, self.tools, True)
        if parsed is None:
            return [{"message": {"role": "assistant", "content": text}}] if text else []
        self.calls = [{"function": {"name": c.function.name,
                                    "arguments": json.loads(c.function.arguments)}}
                      for c in parsed]
        return [{"message": {"role": "assistant", "content": "", "tool_calls": self.calls}}]

    def final(self) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": ""}}

    def whole(self, last: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "" if self.calls else "".join(self.text)}
        if self.thinking:
            message["thinking"] = "".join(self.thinking)
        if self.calls:
            message["tool_calls"] = self.calls
        return {**last, "message": message}


class _GenerateShape(_Shape):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[int] = []
        self.prompt: list[int] = []

    def token(self, event: TokenEvent) -> dict[str, Any] | None:
        if event.token_id >= 0:
            self.ids.append(event.token_id)
        self.text.append(event.text)
        return {"response": event.text} if event.text else None

    def thought(self, text: str) -> dict[str, Any]:
        self.thinking.append(text)
        return {"response": "", "thinking": text}

    def final(self) -> dict[str, Any]:
        return {"response": "", "context": self.prompt + self.ids}

    def whole(self, last: dict[str, Any]) -> dict[str, Any]:
        thinking = {"thinking": "".join(self.thinking)} if self.thinking else {}
        return {**last, "response": "".join(self.text), **thinking}


# -- the routes ------------------------------------------------------------------------------------


def add_routes(app: FastAPI, server: Any, auth: list[Any]) -> None:
    """Ollama's routes on ``app`` over ``server`` (an ``app.OpenAIServer``); their errors are
    Ollama's ``{"error": ...}``."""
    api = OllamaAPI(server)
    app.state.ollama = api

    def answer(handler: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return _error(exc.status, exc.message)

        return run

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [api.model_entry()]})

    async def ps(request: Request) -> Response:
        entry = api.model_entry()
        return JSONResponse({"models": [{**entry, "expires_at": "0001-01-01T00:00:00Z",
                                         "size_vram": 0, "context_length": api.engine.n_ctx}]})

    async def show(request: Request) -> Response:
        req: ShowRequest = await api.parse(request, ShowRequest)
        api.check_model(req.model or req.name or "")
        return JSONResponse(api.show())

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    routes: list[tuple[str, str, Callable[..., Any]]] = [
        ("GET", "/api/tags", tags), ("GET", "/api/ps", ps), ("GET", "/api/version", version),
        ("POST", "/api/show", show), ("POST", "/api/chat", api.chat),
        ("POST", "/api/generate", api.generate), ("POST", "/api/embed", api.embed),
        ("POST", "/api/embeddings", lambda r: api.embed(r, legacy=True)),
    ]
    for method, path, handler in routes:
        deps = [] if path == "/api/version" else auth
        app.add_api_route(path, answer(handler), methods=[method], dependencies=deps,
                          include_in_schema=False)


__all__ = ["OllamaAPI", "add_routes"]
