"""OpenAI-compatible HTTP server over an engine (``sparseinfer.engine.EngineProtocol``).

Routes: ``GET /health`` (never needs a key), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (both also as SSE streams).

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
- ``max_tokens`` (``max_completion_tokens`` for chat) must be >= 1; a value larger than the room
  the prompt leaves in the context window is clamped to that room (the answer then ends with
  ``finish_reason="length"``); unset means "until end of text or the context is full".
- A prompt that leaves no room for one generated token is a 400 ``context_length_exceeded``.
- Unset sampling fields take ``SamplingParams`` defaults (llama.cpp's: temperature 0.8, top_k 40,
  top_p 0.95, min_p 0.05), not OpenAI's; ``top_k``, ``min_p`` and ``repeat_penalty`` are accepted
  as extensions. ``n``, ``best_of`` must be 1; ``logprobs``, ``echo``, ``suffix`` are rejected.
- Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
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
from .protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Health,
    ModelCard,
    ModelList,
    Usage,
    validation_error,
)
from .queue import END, Job, JobFailed, QueueFullError, Scheduler
from .webui import index_html

logger = logging.getLogger(__name__)

_GONE = object()  # event injected when the client disconnects
_DRAIN_LIMIT = 64 << 20  # bytes of an oversized body read and dropped so the client sees the 413
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    """The client disconnected while its request body was being read."""


@dataclass(frozen=True)
class _Call:
    """What one generation request asks for, resolved on the event loop."""

    kind: str  # "chat" | "text"
    build_prompt: Callable[[], list[int]]  # runs on the worker thread
    prompt_param: str  # the request field a prompt problem is blamed on
    params: SamplingParams
    stream: bool
    include_usage: bool


def _sampling(req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """Map the OpenAI request fields onto SamplingParams (unset fields keep its defaults)."""
    kw: dict[str, Any] = {"max_tokens": req.token_limit if req.token_limit is not None else -1}
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
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected >= 1, got {max_body_bytes}")
        self.engine = engine
        self.model_name = model_name or engine.name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.scheduler = Scheduler(max_queue)
        self.created = int(time.time())

    # -- request parsing --------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` (else 413). Reads the ASGI messages
        directly: an oversized body is drained (up to _DRAIN_LIMIT) but never kept."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
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
            if total > _DRAIN_LIMIT:
                raise self._too_large(total, close=True)
            if not message.get("more_body", False):
                break
        if too_big:
            raise self._too_large(total)
        return b"".join(chunks)

    def _too_large(self, size: int, close: bool = False) -> APIError:
        return APIError(
            413,
            f"request body: {size} bytes is larger than the limit of {self.max_body_bytes} bytes",
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
        if req.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {req.n}", param="n")
        problem = req.unsupported()
        if problem is not None:
            raise problem

    # -- prompt building (worker thread) ---------------------------------------------------

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return self.engine.chat_prompt(messages)
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

    def _text_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = getattr(self.engine, "vocab_size", None)
            bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token id {bad[0]} is outside the vocabulary"
                    + (f" [0, {vocab})" if vocab is not None else ""),
                    param="prompt",
                )
            if vocab is None:  # let the tokenizer judge the ids (it raises for unknown ones)
                try:
                    self.engine.decode(prompt)
                except (SparseInferError, ValueError, IndexError, KeyError, OverflowError) as exc:
                    raise APIError(400, f"prompt: {exc}", param="prompt") from None
            return prompt
        try:
            return self.engine.encode(prompt, add_bos=True)
        except UnicodeError as exc:
            raise APIError(400, f"prompt: text is not encodable: {exc}", param="prompt") from None

    def _work(self, call: _Call) -> Callable[[Job], None]:
        engine = self.engine

        def work(job: Job) -> None:
            ids = call.build_prompt()
            n_ctx = engine.n_ctx
            if not ids:
                raise APIError(
                    400, f"{call.prompt_param}: the prompt is empty", param=call.prompt_param
                )
            if len(ids) >= n_ctx:
                raise APIError(
                    400,
                    f"{call.prompt_param}: this model's maximum context length is {n_ctx} tokens "
                    f"but the prompt has {len(ids)} tokens, leaving no room for the completion",
                    param=call.prompt_param,
                    code="context_length_exceeded",
                )
            room = n_ctx - len(ids)
            wanted = call.params.max_tokens
            params = call.params
            if wanted < 0 or wanted > room:
                params = replace(params, max_tokens=room)
            events = engine.stream(ids, params, job.cancel)
            try:
                for event in events:
                    job.emit(event)
                    if job.cancel.is_set() and not isinstance(event, FinishEvent):
                        break
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

        return work

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

    async def run(self, request: Request, call: _Call) -> Response:
        job = Job(self._work(call), asyncio.get_running_loop())
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
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        handed_off = False
        try:
            first = await job.get()
            if first is _GONE:
                return Response(status_code=499)
            if isinstance(first, JobFailed):
                raise self._failure(first)
            if first is END:  # cancelled without running: the server is shutting down
                raise APIError(503, "the server is shutting down", type="server_error")
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

    async def _collect(self, call: _Call, job: Job, event: Any, rid: str) -> Response:
        parts: list[str] = []
        while not isinstance(event, FinishEvent):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
            elif isinstance(event, JobFailed):
                raise self._failure(event)
            elif event is _GONE:
                return Response(status_code=499)
            elif event is END:
                raise APIError(500, "generation ended without a finish event", type="server_error")
            event = await job.get()
        if event.reason == "cancelled":
            raise APIError(
                503, "generation was cancelled (server shutting down)", type="server_error"
            )
        text = "".join(parts)
        usage = Usage(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            total_tokens=event.prompt_tokens + event.completion_tokens,
        )
        created = int(time.time())
        body: BaseModel
        if call.kind == "chat":
            body = ChatCompletion(
                id=rid,
                created=created,
                model=self.model_name,
                usage=usage,
                choices=[
                    ChatChoice(message=AssistantMessage(content=text), finish_reason=event.reason)
                ],
            )
        else:
            body = Completion(
                id=rid,
                created=created,
                model=self.model_name,
                usage=usage,
                choices=[CompletionChoice(text=text, finish_reason=event.reason)],
            )
        return Response(body.model_dump_json(), media_type="application/json")

    def _chunk(
        self,
        call: _Call,
        rid: str,
        created: int,
        *,
        text: str | None = None,
        role: bool = False,
        finish: str | None = None,
        usage: Usage | None = None,
        no_choice: bool = False,
    ) -> str:
        chunk: BaseModel
        if call.kind == "chat":
            choices = (
                []
                if no_choice
                else [
                    ChatChunkChoice(
                        delta=ChatDelta(role="assistant" if role else None, content=text),
                        finish_reason=finish,
                    )
                ]
            )
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
        else:
            choices = [] if no_choice else [CompletionChoice(text=text or "", finish_reason=finish)]
            chunk = Completion(
                id=rid, created=created, model=self.model_name, choices=choices, usage=usage
            )
        return f"data: {chunk.model_dump_json()}\n\n"

    async def _sse(
        self, call: _Call, job: Job, event: Any, watcher: asyncio.Task[None], rid: str
    ) -> AsyncIterator[str]:
        created = int(time.time())
        try:
            if call.kind == "chat":
                yield self._chunk(call, rid, created, text="", role=True)
            while True:
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield self._chunk(call, rid, created, text=event.text)
                elif isinstance(event, FinishEvent):
                    if event.reason == "cancelled":
                        return
                    yield self._chunk(call, rid, created, finish=event.reason)
                    if call.include_usage:
                        usage = Usage(
                            prompt_tokens=event.prompt_tokens,
                            completion_tokens=event.completion_tokens,
                            total_tokens=event.prompt_tokens + event.completion_tokens,
                        )
                        yield self._chunk(call, rid, created, usage=usage, no_choice=True)
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(event, JobFailed):
                    yield f"data: {self._failure(event).body().model_dump_json()}\n\n"
                    return
                elif event is _GONE or event is END:
                    return
                event = await job.get()
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
        call = _Call(
            kind="chat",
            build_prompt=lambda: self._chat_ids(messages),
            prompt_param="messages",
            params=_sampling(req),
            stream=req.stream,
            include_usage=req.include_usage,
        )
        return await self.run(request, call)

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        self.check_common(req)
        prompt = req.single_prompt()
        call = _Call(
            kind="text",
            build_prompt=lambda: self._text_ids(prompt),
            prompt_param="prompt",
            params=_sampling(req),
            stream=req.stream,
            include_usage=req.include_usage,
        )
        return await self.run(request, call)

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created)

    def health(self) -> Health:
        return Health(
            model=self.model_name,
            running=self.scheduler.running,
            queued=self.scheduler.queued,
            max_queue=self.scheduler.max_queue,
        )


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=exc.headers)


def create_app(
    engine: EngineProtocol,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = 16,
    max_body_bytes: int = 1 << 20,
) -> FastAPI:
    """The FastAPI app serving ``engine``. Its worker thread runs while the app's lifespan does."""
    server = OpenAIServer(
        engine,
        model_name=model_name,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.scheduler.close)

    app = FastAPI(title="sparseinfer", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning(
                "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message
            )
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

    auth = [Depends(server.check_auth)]

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in (server.model_name, engine.name):
            raise APIError(
                404,
                f"model: the model {model_id!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return server.model_card()

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await server.completions(request)

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
    except OSError:
        sock.close()
        raise
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server that sets ``ready`` once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready: threading.Event | None) -> None:
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready is not None:
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
    )
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    logger.info("serving %s on http://%s:%d/v1", app.state.server.model_name, host, bound)
    server = _Uvicorn(_config(app, log_level, **uvicorn_kw), ready)
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
