"""A small deterministic engine implementing ``sparseinfer.engine.EngineProtocol`` for server tests.

Tokens are bytes (id = byte + 3; BOS 1, EOS 2). The chat template renders ``<|role|>content\\n``
per message and ends with ``<|assistant|>``. Generation yields whole words from ``SCRIPT`` in a
cycle, one word per token, unless the prompt contains ``[[say:...]]``: then it yields those words
and stops (reason "stop", like an end-of-text token); ``[[spell:...]]`` yields those characters,
one a token. ``[[fail]]`` raises after two tokens.

``think=True`` makes it a thinking model (``think_tags``) whose template takes Qwen3's
``enable_thinking`` (false: an empty thought closes the prompt); ``think="open"`` also opens the
thought at the end of the prompt, as DeepSeek-R1's template does. Template variables are
recorded (``template_kwargs``).

With ``logprobs=k`` each token reports logprob ``-n / 10`` (n-th token) and ``k`` alternatives;
``score`` gives prompt token i the logprob ``-(i % 5) / 10 - 0.5``; ``embed`` the unit vector
along (token count, id sum, 1 for mean pooling or 2 for last). ``processors`` are recorded,
not applied (the words are scripted).

``token_delay`` / ``prefill_delay`` make timing deterministic for queue tests; the engine records
every prompt it starts (``started``), the params it got, and whether it was ever entered from two
threads at once (``overlap``) or from more than one thread (``threads``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

from sparseinfer.config import SamplingParams
from sparseinfer.engine import FinishEvent, StreamEvent, TokenEvent, TokenScore
from sparseinfer.errors import ContextOverflowError
from sparseinfer.reasoning import THINK

SCRIPT = "one two three four five six seven eight nine ten".split()
BOS, EOS, OFFSET = 1, 2, 3
_SAY = re.compile(r"\[\[say:(.*?)\]\]", re.S)
_SPELL = re.compile(r"\[\[spell:(.*?)\]\]", re.S)


class FakeEngine:
    vocab_size = 256 + OFFSET

    def __init__(
        self,
        name: str = "fake-model",
        n_ctx: int = 256,
        token_delay: float = 0.0,
        prefill_delay: float = 0.0,
        think: bool | str = False,
    ) -> None:
        self.name = name
        self.think = think
        self.think_tags = THINK if think else None
        self.template_kwargs: list[dict | None] = []
        self.n_ctx = n_ctx
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.started: list[str] = []  # decoded prompts, in the order generation began
        self.params: list[SamplingParams] = []
        self.processors: list[list] = []
        self.cancelled = 0
        self.threads: set[int] = set()
        self.overlap = False
        self._busy = threading.Lock()

    # -- EngineProtocol --

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        with self._enter():
            return ([BOS] if add_bos else []) + [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]], template_kwargs=None) -> list[int]:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"role: expected system, user or assistant, got {m['role']!r}")
        self.template_kwargs.append(template_kwargs)
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
        if self.think and (template_kwargs or {}).get("enable_thinking") is False:
            text += "<think>\n\n</think>\n\n"
        elif self.think == "open":
            text += "<think>\n"
        return self.encode(text)

    def score(self, ids: list[int], top: int = 0) -> list[TokenScore]:
        return [TokenScore(ids[0], None)] + [
            TokenScore(t, -(i % 5) / 10 - 0.5, self._top(t, -(i % 5) / 10 - 0.5, top))
            for i, t in enumerate(ids[1:], 1)
        ]

    def embed(self, ids: list[int], pooling: str = "mean") -> list[float]:
        """(token count, id sum, 1 for mean pooling / 2 for last), scaled to unit length."""
        with self._enter():
            v = [float(len(ids)), float(sum(ids)), 1.0 if pooling == "mean" else 2.0]
            norm = sum(x * x for x in v) ** 0.5
            return [x / norm for x in v]

    @staticmethod
    def _top(tok: int, lp: float, k: int) -> tuple[tuple[int, float], ...]:
        return tuple((tok + j, lp - j) for j in range(k))

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cancel: threading.Event | None = None,
        *,
        processors=(),
        logprobs: int | None = None,
    ) -> Iterator[StreamEvent]:
        cancel = cancel or threading.Event()
        self.processors.append(list(processors))
        self._logprobs = logprobs
        room = self.n_ctx - len(prompt_ids)
        if room <= 0 or params.max_tokens > room:
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} does not fit "
                f"the context of {self.n_ctx}"
            )
        return self._generate(prompt_ids, params, cancel, room)

    # -- internals --

    def _enter(self) -> _Entered:
        return _Entered(self)

    def _generate(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event, room: int
    ) -> Iterator[StreamEvent]:
        """``_events``, counting a cancellation the server makes by closing the stream: told to
        cancel between two tokens, it closes the generator before the engine's next
        ``cancel.wait`` would have seen it (one count per cancelled stream either way)."""
        events, last = self._events(prompt_ids, params, cancel, room), None
        try:
            for last in events:
                yield last
        except GeneratorExit:
            if cancel.is_set() and not (isinstance(last, FinishEvent) and last.reason == "cancelled"):
                self.cancelled += 1
            raise
        finally:
            events.close()

    def _events(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event, room: int
    ) -> Iterator[StreamEvent]:
        with self._enter():
            prompt = self.decode(prompt_ids)
            self.started.append(prompt)
            self.params.append(params)
            said, spelled = _SAY.search(prompt), _SPELL.search(prompt)
            words = said.group(1).split() if said else None
            if spelled:
                words = list(spelled.group(1))
            sep = "" if spelled else " "
            limit = room if params.max_tokens < 0 else params.max_tokens
            if self.prefill_delay and cancel.wait(self.prefill_delay):
                self.cancelled += 1
                yield FinishEvent("cancelled", len(prompt_ids), 0)
                return
            pending = ""  # text held back because it may begin a stop string
            n = 0
            while True:
                if words is not None and n == len(words):
                    if pending:
                        yield TokenEvent(EOS, pending)
                    yield FinishEvent("stop", len(prompt_ids), n)
                    return
                if n == limit:
                    if pending:
                        yield TokenEvent(EOS, pending)
                    yield FinishEvent("length", len(prompt_ids), n)
                    return
                if "[[fail]]" in prompt and n == 2:
                    raise RuntimeError("fake engine failure")
                if cancel.is_set() or (self.token_delay and cancel.wait(self.token_delay)):
                    self.cancelled += 1
                    yield FinishEvent("cancelled", len(prompt_ids), n)
                    return
                word = (words or SCRIPT)[n % len(words or SCRIPT)]
                n += 1
                pending += word if n == 1 else sep + word
                hit = [(pending.index(s), s) for s in params.stop if s in pending]
                if hit:
                    cut, stop = min(hit, key=lambda h: h[0])
                    yield self._token(100 + n, pending[:cut], n)
                    yield FinishEvent("stop", len(prompt_ids), n, stop_string=stop)
                    return
                keep = max(
                    (k for s in params.stop for k in range(1, len(s)) if pending.endswith(s[:k])),
                    default=0,
                )
                out, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
                yield self._token(100 + n, out, n)


    def _token(self, tok: int, text: str, n: int) -> TokenEvent:
        if self._logprobs is None:
            return TokenEvent(tok, text)
        lp = -n / 10
        return TokenEvent(tok, text, lp, self._top(tok, lp, self._logprobs))


class _Entered:
    """Records which thread uses the engine and whether two ever overlap."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine.threads.add(threading.get_ident())
        if not self.engine._busy.acquire(blocking=False):
            self.engine.overlap = True
            self.engine._busy.acquire()

    def __exit__(self, *exc: object) -> None:
        self.engine._busy.release()
