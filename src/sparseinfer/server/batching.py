"""Continuous batching (``serve --parallel N``, llama.cpp's ``-np``): an ``EngineProtocol`` over an
``Engine`` that serves up to N streams together.

One loop thread owns the model. Each of its iterations, at a token boundary:

1. admits waiting sequences into free slots of one KV cache (N slots, one per sequence): the
   free slot whose cache already holds the longest prefix of the prompt (a shared system prompt,
   the previous turns of a chat; llama.cpp's ``cache_prompt``), whose tokens are then not run
   again — only where that changes no number (``Transformer.rows_exact``);
2. drops sequences whose consumer stopped (stop string, cancelled, client gone): the slot is
   free for the next one;
3. takes prompt rows of the sequences still reading their prompts, oldest first (the next one's
   when a prompt ends within the step's rows): a whole chunk (``prefill_chunk`` tokens) while
   nothing generates, and while something does as many as the
   ``PromptBudget`` gives (Sarathi-Serve's token budget): by default ``TimeBudget``, the rows
   that keep the step within 3 times a step of the generating rows alone by a line fitted to
   the step times measured so far (at 7B a whole chunk held every running stream for over half
   a second; a tighter ratio holds them less and delays the newcomer's first token more:
   benchmarks/RESULTS.md), or a fixed ``RowBudget``, or ``WholeChunk``;
4. runs one ``models.batch.decode_step`` over the next token of every sequence that is
   generating and the prompt chunk's tokens (as llama.cpp's server mixes them in one batch):
   the weights are read once for all rows, each row attends to its own slot up to its own
   position; only the rows that pick a token go through the output head;
5. samples each generating row (and the prompt's last, when its chunk ends it) with its own
   RNG, penalties, logits processors and logprobs, and hands the token to that sequence's
   consumer.

``stream()`` runs on the caller's thread (the server's workers, one per running request): it
queues the sequence, then turns the loop's token ids into text (incremental decoding, stop
strings) exactly like ``Engine.stream``. A sequence's prompt and tokens always go through
``decode_step``, alone or not, so its numbers do not depend on the fused single-token path, the
one-sequence prefill or what else runs in its steps.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingParams
from ..engine import Engine, FinishEvent, StopStrings, StreamEvent, TokenEvent, TokenScore
from ..generate import Uniforms, apply_penalties, sample, token_logprobs
from ..models.batch import decode_step, slot_cache
from ..reasoning import ThinkTags

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds a consumer waits for a token before looking at its cancel event


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptBudget:
    """How many of a newcomer's prompt tokens a step takes beside ``decoding`` generating rows
    (at most ``chunk``, at least one), told each step's time. Called on the loop thread only."""

    def rows(self, decoding: int, chunk: int) -> int:
        raise NotImplementedError

    def observe(self, decoding: int, prompt: int, seconds: float) -> None:
        """A step ran ``decoding`` generating rows and ``prompt`` prompt rows in ``seconds``."""


class WholeChunk(PromptBudget):
    """No budget: a whole chunk in every step (llama.cpp's server mixes its batch the same way)."""

    def rows(self, decoding: int, chunk: int) -> int:
        return chunk


@dataclass(frozen=True)
class RowBudget(PromptBudget):
    """Steps of at most ``step_rows`` rows while something generates: the prompt takes the rows
    the generating ones leave (at least one)."""

    step_rows: int

    def __post_init__(self) -> None:
        if self.step_rows < 1:
            raise ValueError(f"step_rows: expected >= 1, got {self.step_rows}")

    def rows(self, decoding: int, chunk: int) -> int:
        return chunk if not decoding else min(chunk, max(1, self.step_rows - decoding))


class TimeBudget(PromptBudget):
    """While something generates, the prompt rows that keep a step within ``ratio`` times a step
    of the generating rows alone, from a line fitted to the measured step times: seconds =
    fixed + per_row x rows (generating and prompt rows alike: each a token through the model),
    by least squares over the recent steps (each older step's weight times ``DECAY``). A step of
    g generating rows alone then takes fixed + per_row x g, and n prompt rows add per_row x n.
    Steps of the generating rows alone are rare under load (a newcomer's prompt waits at nearly
    every step), so both come from the line; taking them from such steps only left a stale
    estimate standing for a larger batch and charged the prompt rows with the difference
    (benchmarks/RESULTS.md, session 41). Until the line is known (steps of different sizes
    seen) a step takes as many prompt rows as rows generate; after that at most twice what the
    last carrying step took, so a wrong estimate costs one step, not a whole chunk."""

    DECAY = 0.98  # the weight each step's time loses per later step
    MIN_SPREAD = 0.25  # the rows' weighted variance below which the line is not known

    def __init__(self, ratio: float = 3.0) -> None:
        if not 1.0 < ratio < math.inf:
            raise ValueError(f"ratio: expected a finite number > 1, got {ratio}")
        self.ratio = ratio
        self._sums = [0.0] * 5  # weighted count, rows, seconds, rows^2, rows x seconds
        self.last = 0  # prompt rows the last step that carried some took

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds of the fitted line, or None before it is known."""
        w, x, y, xx, xy = self._sums
        if w <= 0.0:
            return None
        mx, my = x / w, y / w
        var = xx / w - mx * mx
        if var < self.MIN_SPREAD:
            return None
        per_row = max((xy / w - mx * my) / var, 1e-9)  # noise can tilt it below 0
        return max(my - per_row * mx, 0.0), per_row

    def rows(self, decoding: int, chunk: int) -> int:
        if not decoding:
            return chunk
        fit = self.line()
        if fit is None:
            n = decoding
        else:
            fixed, per_row = fit
            n = int((self.ratio - 1.0) * (fixed + per_row * decoding) / per_row)
            n = min(n, 2 * max(1, self.last))
        return max(1, min(chunk, n))

    def observe(self, decoding: int, prompt: int, seconds: float) -> None:
        if decoding and prompt:
            self.last = prompt
        rows = decoding + prompt
        self._sums = [self.DECAY * v for v in self._sums]
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self._sums[i] += v


def prompt_budget(step_rows: int = 0, step_ratio: float = 3.0) -> PromptBudget:
    """The budget ``serve`` options ask for: ``RowBudget(step_rows)`` when it is positive, else
    ``TimeBudget(step_ratio)``, or ``WholeChunk`` when that is 0."""
    if step_rows < 0:
        raise ValueError(f"step_rows: expected 0 (none) or a positive number, got {step_rows}")
    if step_ratio != 0 and not 1.0 < step_ratio < math.inf:
        raise ValueError(f"step_ratio: expected 0 (none) or a finite number > 1, got "
                         f"{step_ratio}")
    if step_rows:
        return RowBudget(step_rows)
    return TimeBudget(step_ratio) if step_ratio else WholeChunk()


@dataclass(eq=False)
class _Seq:
    prompt: list[int]
    params: SamplingParams
    rng: Uniforms
    processors: tuple[Any, ...]
    logprobs: int | None
    limit: int  # tokens to generate at most
    stop_ids: frozenset[int]
    out: queue.Queue = field(default_factory=queue.Queue)
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    pending: int | None = None  # sampled, not yet run through the model
    generated: list[int] = field(default_factory=list)
    done: bool = False  # set by the consumer: stop at the next token boundary
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    @property
    def pos(self) -> int:  # the position of ``pending``
        return len(self.prompt) + len(self.generated) - 1


class BatchEngine:
    """Serves up to ``parallel`` generations at once over ``engine``'s model; see the module
    docstring. Tokenizing and templating are delegated to ``engine`` (thread-safe)."""

    def __init__(self, engine: Engine, parallel: int, prefill_chunk: int = 64,
                 cache_prompt: bool = True, budget: PromptBudget | None = None) -> None:
        if parallel < 1:
            raise ValueError(f"parallel: expected >= 1, got {parallel}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: expected >= 1, got {prefill_chunk}")
        self.engine = engine
        self.name = engine.name
        self.n_ctx = engine.n_ctx
        self.parallel = parallel
        self.prefill_chunk = prefill_chunk
        self.budget = TimeBudget() if budget is None else budget
        self.model = engine.model
        self.cache = self.model.new_cache(parallel, self.n_ctx)
        from ..fused.decode import attend_rows, supports

        # the fused per-row attention kernel for plain layers where it applies (CPU fp32 rope
        # models): no torch parallel regions for the small attention ops (costly on a busy
        # 2-core machine); other layers (q/k norms, windows, soft-capping) attend in torch
        self._kernel = attend_rows if supports(self.model) else None
        self._views = [slot_cache(self.cache, s) for s in range(parallel)]  # kept: stable ids
        self._free = list(range(parallel))
        # per slot, the tokens whose keys and values its cache holds at positions 0.. (reused by
        # the next prompt that starts with them, when that changes no number)
        self._held: list[list[int]] = [[] for _ in range(parallel)]
        self._reuse = cache_prompt and self.model.rows_exact()
        self.reused_tokens = 0  # prompt tokens not run again (for tests and benchmarks)
        self._cv = threading.Condition()
        self._incoming: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._tasks: deque[tuple[Any, queue.Queue]] = deque()
        self._closed = False
        self.steps = 0  # decode steps run (for tests and benchmarks)
        self.max_batch = 0  # the most sequences one decode step has had
        self.max_rows_decoding = 0  # the most rows of a step that also decoded
        self._thread = threading.Thread(target=self._loop, name="sparseinfer-batch", daemon=True)
        self._thread.start()

    # -- EngineProtocol: text (delegated) --

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.engine.encode(text, add_bos)

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    def chat_prompt(self, messages: list[dict[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        return self.engine.chat_prompt(messages, template_kwargs)

    @property
    def think_tags(self) -> ThinkTags | None:
        return self.engine.think_tags

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.engine.eos_ids

    def tokenizer_json(self) -> str:
        return self.engine.tokenizer_json()

    # -- generation --

    def details(self) -> dict:
        return self.engine.details()

    def score(self, ids: list[int], top: int = 0) -> list[TokenScore]:
        """``Engine.score``, run on the loop thread between steps."""
        self.engine.check_fits(len(ids))
        return self._between_steps(lambda: self._score(list(ids), top))

    def embed(self, ids: list[int], pooling: str = "mean") -> list[float]:
        """``Engine.embed``, run on the loop thread between steps."""
        from ..generate import embedding

        self.engine.check_embeddable(len(ids))
        return self._between_steps(
            lambda: embedding(self.model, list(ids), self._scratch_cache(), pooling).tolist())

    def _between_steps(self, task: Callable[[], Any]) -> Any:
        """``task()``'s value (or exception), run on the loop thread between two steps."""
        done: queue.Queue = queue.Queue()
        with self._cv:
            self._tasks.append((task, done))
            self._cv.notify()
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def stream(self, prompt_ids, params: SamplingParams, cancel=None, *, processors=(),
               logprobs: int | None = None) -> Iterator[StreamEvent]:
        prompt = list(prompt_ids)
        self.engine.check_fits(len(prompt))  # raises before anything is yielded
        return self._stream(prompt, params, cancel, tuple(processors), logprobs)

    def _stream(self, prompt: list[int], params: SamplingParams, cancel, processors,
                logprobs) -> Iterator[StreamEvent]:
        rng = Uniforms(params.seed)
        limit = self.n_ctx - len(prompt)
        if params.max_tokens >= 0:
            limit = min(limit, params.max_tokens)
        stop_ids = frozenset() if params.ignore_eos else self.engine.eos_ids
        seq = _Seq(prompt, params, rng, processors, logprobs, limit, stop_ids)
        with self._cv:
            if self._closed:
                raise RuntimeError("the batch engine is closed")
            self._incoming.append(seq)
            self._cv.notify()
        decoder = self.engine.tokenizer.decoder()
        stopper = StopStrings(params.stop)
        n_out, reason = 0, "length"
        try:
            while True:
                try:
                    item = seq.out.get(timeout=_POLL)
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        reason = "cancelled"
                        break
                    continue
                kind = item[0]
                if kind == "error":
                    raise item[1]
                if kind == "end":
                    reason = item[1]
                    n_out += item[2]  # an end-of-text token counts, as in Engine.stream
                    break
                _, tok, lp, top = item
                n_out += 1
                text, hit = stopper.push(decoder.push(tok))
                yield TokenEvent(tok, text, lp, top) if lp is not None else TokenEvent(tok, text)
                if hit:
                    reason = "stop_string"
                    break
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
            if reason == "stop_string":
                reason = "stop"
            elif reason != "cancelled":
                text, _ = stopper.push(decoder.flush(), final=True)
                if text:
                    yield TokenEvent(-1, text)
        finally:
            seq.done = True
            with self._cv:
                self._cv.notify()
        t_end = time.perf_counter()
        t_first = seq.t_first or t_end
        yield FinishEvent(reason, len(prompt), n_out, t_first - seq.t_start, t_end - t_first,
                          stopper.hit)

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # -- the loop thread --

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._closed or self._incoming or self._active or self._tasks):
                    self._cv.wait()
                if self._closed:
                    for seq in list(self._incoming) + self._active:
                        seq.out.put(("end", "cancelled", 0))
                    return
                tasks = list(self._tasks)
                self._tasks.clear()
                while self._incoming and self._free:  # 1. admit
                    self._admit(self._incoming.popleft())
            try:
                with torch.inference_mode():
                    for task, done in tasks:
                        try:
                            done.put((True, task()))
                        except Exception as exc:  # delivered to the caller
                            done.put((False, exc))
                    self._iterate()
            except Exception as exc:  # a bug or an engine failure: fail every active stream
                logger.error("batch step failed", exc_info=exc)
                for seq in list(self._active):
                    seq.out.put(("error", exc))
                    self._release(seq)
                self._held = [[] for _ in range(self.parallel)]  # a step cut short: unknown

    def _admit(self, seq: _Seq) -> None:
        """Give ``seq`` the free slot holding the longest prefix of its prompt (the lowest
        free slot when none does, or without reuse); those tokens count as prefilled (all but
        the last: its logits pick the first token)."""
        slot, shared = self._free[0], 0
        if self._reuse:
            for s in self._free:
                n = common_prefix(self._held[s], seq.prompt)
                if n > shared:
                    slot, shared = s, n
        self._free.remove(slot)
        seq.slot = slot
        seq.prefilled = min(shared, len(seq.prompt) - 1)
        self.reused_tokens += seq.prefilled
        self._held[slot] = []  # rewritten from position seq.prefilled on; recorded at release
        self._active.append(seq)

    def _release(self, seq: _Seq) -> None:
        if seq in self._active:
            self._active.remove(seq)
        if seq.slot is not None:
            # its cache holds the prompt it ran and every generated token but the last (sampled,
            # not yet run through the model)
            ran = seq.prompt[:seq.prefilled]
            if seq.prefilled == len(seq.prompt):
                ran = ran + seq.generated[:-1]
            self._held[seq.slot] = ran
            self._free.append(seq.slot)
            self._free.sort()  # lowest slots first: active slots stay consecutive more often
            seq.slot = None

    def _iterate(self) -> None:
        for seq in [s for s in self._active if s.done]:  # 2. drop finished consumers
            self._release(seq)
        decoding = [s for s in self._active if s.pending is not None and s.slot is not None]
        decoding.sort(key=lambda s: s.slot)
        tokens = [s.pending for s in decoding]
        positions = [s.pos for s in decoding]
        slots = [s.slot for s in decoding]
        takers = list(decoding)  # the sequences that get a logits row, in row order
        logit_rows = list(range(len(decoding)))
        prefilling = [s for s in self._active if s.prefilled < len(s.prompt)]
        if prefilling:  # 3. prompts' next rows, oldest first, as more rows of the same step
            take = self.budget.rows(len(decoding), self.prefill_chunk)
            for seq in prefilling:
                if take <= 0:
                    break
                start = seq.prefilled
                chunk = seq.prompt[start:start + take]
                tokens += chunk
                positions += range(start, start + len(chunk))
                slots += [seq.slot] * len(chunk)
                seq.prefilled += len(chunk)
                take -= len(chunk)
                if seq.prefilled == len(seq.prompt):  # its last row: its first token
                    takers.append(seq)
                    logit_rows.append(len(tokens) - 1)
        if not tokens:
            return
        t0 = time.perf_counter()
        logits = decode_step(self.model, torch.tensor(tokens), torch.tensor(positions),  # 4.
                             self.cache, torch.tensor(slots), self._kernel,
                             torch.tensor(logit_rows, dtype=torch.long))
        self.budget.observe(len(decoding), len(tokens) - len(decoding), time.perf_counter() - t0)
        self.steps += 1
        self.max_batch = max(self.max_batch, len(set(slots)))
        if decoding:
            self.max_rows_decoding = max(self.max_rows_decoding, len(tokens))
        for row, seq in enumerate(takers):  # 5. sample each sequence's row
            self._sampled(seq, logits[row])

    def _sampled(self, seq: _Seq, logits: torch.Tensor) -> None:
        """Sample ``seq``'s next token from ``logits`` and hand it over (or end the sequence)."""
        if seq.done:
            self._release(seq)
            return
        p = seq.params
        logits = apply_penalties(logits, seq.prompt + seq.generated, p)
        for proc in seq.processors:
            logits = proc(seq.generated, logits)
        tok = sample(logits, p, seq.rng)
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
        seq.generated.append(tok)
        if tok in seq.stop_ids:
            seq.out.put(("end", "stop", 1))
            self._release(seq)
            return
        lp = top = None
        if seq.logprobs is not None:
            lp_t, top_lp, top_ids = token_logprobs(logits.view(1, -1), torch.tensor([tok]),
                                                   seq.logprobs)
            lp = float(lp_t[0])
            top = () if top_ids is None else tuple(zip(top_ids[0].tolist(), top_lp[0].tolist()))
        seq.out.put(("token", tok, lp, top))
        if len(seq.generated) >= seq.limit or seq.pos + 1 >= self.n_ctx:
            seq.out.put(("end", "length", 0))
            self._release(seq)
            return
        seq.pending = tok

    def _scratch_cache(self):
        """A free slot's cache, forgetting what it held (or, with none free, a temporary
        cache), for work that runs from position 0 and keeps nothing."""
        if self._free:
            self._held[self._free[0]] = []  # overwritten by the caller
            return self._views[self._free[0]]
        return self.model.new_cache(1, self.n_ctx)

    def _score(self, ids: list[int], top: int) -> list[TokenScore]:
        """Prompt logprobs in a scratch cache."""
        from ..generate import score

        lp, top_lp, top_ids = score(self.model, ids, self._scratch_cache(), top)
        out = [TokenScore(ids[0], None, ())]
        for i, tok in enumerate(ids[1:]):
            alts = () if top_ids is None else tuple(zip(top_ids[i].tolist(), top_lp[i].tolist()))
            out.append(TokenScore(tok, float(lp[i]), alts))
        return out
