"""The engine interface: what the CLI and the server talk to, never the model directly.

An ``Engine`` owns one loaded model, its tokenizer and a KV cache. It is not thread-safe: a caller
that serves several clients runs it from one worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .config import SamplingParams
from .errors import ContextOverflowError, SparseInferError
from .reasoning import ThinkTags, template_tags
from .threads import default_threads, small_model_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the text that became final with it (may be "").

    With ``stream(..., logprobs=k)``: ``logprob`` of the token and its ``k`` best alternatives
    ``top`` as (id, logprob), from the logits it was sampled from (after penalties and logits
    processors, before temperature / top-k / top-p). ``token_id`` -1 carries held-back text only.
    """

    token_id: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenScore:
    """One prompt token scored by ``Engine.score``: its logprob given the tokens before it
    (None for the first token) and the best ``top`` alternatives at its position."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The last event of a stream."""

    reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_string: str | None = None  # reason "stop" by this stop string (not end of text)


StreamEvent = TokenEvent | FinishEvent


class EngineProtocol(Protocol):
    """What the server needs. Optional capabilities, used when present: ``stream(...,
    processors=, logprobs=)`` keywords (logit_bias, grammars, logprobs), ``score(ids, top)``
    (prompt logprobs for ``echo``), ``vocab_size`` / ``eos_ids`` / ``tokenizer_json()``
    (grammars), ``parallel`` (how many streams may run at once; default 1), ``embed(ids,
    pooling)`` (``/v1/embeddings``), ``think_tags`` (a ``reasoning.ThinkTags`` when the model
    writes its thoughts before its answer)."""

    name: str  # model id shown by /v1/models
    n_ctx: int  # context window in tokens

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Render ``messages`` with the model's chat template (generation prompt added; more
        template variables from ``template_kwargs``, e.g. ``enable_thinking``), tokenize."""
        ...

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cancel: threading.Event | None = None,
    ) -> Iterator[StreamEvent]:
        """Generate from ``prompt_ids``; yields TokenEvents then exactly one FinishEvent.

        Raises ContextOverflowError (before yielding anything) when the prompt does not fit.
        Stop strings in ``params.stop`` end generation with reason "stop"; their text is not
        yielded. Setting ``cancel`` ends the stream early with reason "cancelled".
        """
        ...


class Engine:
    """A loaded model, its tokenizer and one KV cache; implements ``EngineProtocol``."""

    def __init__(self, loaded, n_ctx: int | None = None, threads: int | None = None):
        import torch

        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.source.name  # the file's stem, or the Ollama / Hugging Face name
        self.n_ctx = min(n_ctx or 4096, loaded.config.max_seq_len)
        if threads:
            set_threads(threads)
        self.threads = threads or torch.get_num_threads()  # (load: the count it set)
        self._cache = self.model.new_cache(1, self.n_ctx)
        self._cached_ids: list[int] = []  # tokens whose keys/values are in the cache
        self._torch = torch
        self.sparse_info = None  # set by load() when the model has sparse FFN layers
        self.load_seconds = getattr(loaded, "load_seconds", 0.0)  # open, plan, build and fill
        plan = getattr(loaded, "plan", None)
        self.dtype = plan.label if plan is not None else str(self.model.dtype)

    @classmethod
    def load(cls, path=None, *, n_ctx: int | None = None, threads: int | None = None,
             dtype: str = "auto", kernels: bool = True, **sparse_options) -> Engine:
        """Load a model file (default: the embedded SmolLM2) and wrap it. ``threads``: None for
        the default (the cores; one for a small model without the C library:
        ``threads.small_model_threads``).

        The load plan (``models/plan.py``) decides every weight's storage before anything is
        read: ``dtype`` "auto" (default) keeps each tensor's own precision (a Q4_0/Q4_1/Q4_K
        file's 4-bit blocks on torch's int4 kernel, other quantized types as int8, float as
        fp32), "q4" makes every projection 4-bit with an int8 LM head, "fp32"/"bf16" float.
        ``sparse_options`` (dense, threshold, device, vram_budget, ffn_dtype, mode...) shape the
        sparse FFN layers of a file that carries predictors; ``kv_type`` (auto, fp32, fp16) the
        KV cache's elements. ``kernels`` picks the fused numba
        single-token decode (norms, rope, attention) where the model allows it.
        """
        from .data import default_model_path
        from .models.build import load
        from .sparse.runtime import sparse_info

        n = threads or default_threads()
        set_threads(n)
        loaded = load(path or default_model_path(), dtype, n_ctx=n_ctx, fused=kernels,
                      **sparse_options)
        if not threads and small_model_threads(loaded.plan):
            log.info("one thread by default: a model this small on torch's and numba's kernels "
                     "runs faster on one (-t to choose)")
            n = 1
            set_threads(n)
        engine = cls(loaded, n_ctx=n_ctx)
        engine.threads = n
        engine.load_seconds = loaded.load_seconds
        engine.sparse_info = sparse_info(loaded.model, loaded.plan)
        engine.dtype = loaded.plan.label
        return engine

    def details(self) -> dict:
        """What Ollama's ``/api/tags`` and ``/api/show`` say of the model: its family, format,
        parameter count, the weights' main type in the file, hidden size and file size."""
        import math
        from collections import Counter

        src, cfg = self.loaded.source, self.loaded.config
        n = sum(math.prod(t.shape) for t in src.tensors.values())
        by_kind: Counter[str] = Counter()
        for t in src.tensors.values():
            by_kind[t.kind.upper()] += t.nbytes
        return {"family": cfg.arch, "format": "gguf" if src.format == "gguf" else "safetensors",
                "parameter_size": f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M",
                "quantization_level": by_kind.most_common(1)[0][0] if by_kind else "",
                "embedding_length": cfg.d_model, "file_bytes": src.file_bytes}

    # ---- text ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids

    def tokenizer_json(self) -> str:
        """The tokenizer in the ``tokenizers`` JSON form (for grammar compilers)."""
        return self.tokenizer.backend_json()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=None if add_bos else False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def think_tags(self) -> ThinkTags | None:
        """The tags around the model's thoughts if its chat template is a thinking model's."""
        return template_tags(self.tokenizer.chat_template)

    def chat_prompt(self, messages: list[dict[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  template_kwargs=template_kwargs)
        # the template writes BOS itself when the model wants one
        return self.tokenizer.encode(text, add_bos=False)

    # ---- generation ----------------------------------------------------------------------------

    def warmup(self) -> float:
        """Run the one-time work of the first generation now, outside any timed region, as
        llama.cpp's warm-up does: a two-token prefill and a single-token decode step (numba
        kernels loaded from their on-disk cache, the fused decode's buffers allocated, the C
        kernels' threads started). The cache is then treated as empty. Returns the seconds."""
        import time

        t0 = time.perf_counter()
        tok = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0
        torch = self._torch
        with torch.inference_mode():
            self.model(torch.tensor([[tok, tok]]), 0, self._cache, last_only=True)
            self.model(torch.tensor([[tok]]), 2, self._cache, last_only=True)
        self._cached_ids = []
        dt = time.perf_counter() - t0
        log.info("warm-up: %.0f ms", dt * 1e3)
        return dt

    def forget_prefix(self) -> None:
        """Forget which tokens the KV cache holds: the next request prefills its whole prompt
        (a benchmark timing prefill after a warm-up run of the same prompt)."""
        self._cached_ids = []

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt == 0:
            raise SparseInferError("the prompt is empty: expected at least one token")
        if n_prompt >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {n_prompt} tokens but the context holds {self.n_ctx}; "
                f"shorten the prompt or raise the context size (-c)"
            )

    def check_embeddable(self, n: int) -> None:
        if n == 0:
            raise SparseInferError("the input is empty: expected at least one token")
        if n > self.n_ctx:
            raise ContextOverflowError(f"the input has {n} tokens but the context holds "
                                       f"{self.n_ctx}; shorten it or raise the context size (-c)")

    def score(self, ids, top: int = 0) -> list[TokenScore]:
        """Teacher-forced logprobs of every token of ``ids`` given the ones before it (the first
        has none), with ``top`` alternatives per position; runs from position 0 (no reuse)."""
        from .generate import score

        ids = list(ids)
        self.check_fits(len(ids))
        self._cached_ids = []  # the cache is overwritten from position 0
        with self._torch.inference_mode():
            lp, top_lp, top_ids = score(self.model, ids, self._cache, top)
        out = [TokenScore(ids[0], None, ())]
        for i, tok in enumerate(ids[1:]):
            alts = () if top_ids is None else tuple(
                zip(top_ids[i].tolist(), top_lp[i].tolist()))
            out.append(TokenScore(tok, float(lp[i]), alts))
        return out

    def embed(self, ids, pooling: str = "mean") -> list[float]:
        """The text ``ids`` as one unit-length vector (``generate.embedding``); runs from
        position 0 (no reuse). Unlike a prompt, a text may fill the whole context."""
        from .generate import embedding

        ids = list(ids)
        self.check_embeddable(len(ids))
        self._cached_ids = []  # the cache is overwritten from position 0
        with self._torch.inference_mode():
            return embedding(self.model, ids, self._cache, pooling).tolist()

    def stream(self, prompt_ids, params: SamplingParams, cancel=None, *,
               processors=(), logprobs: int | None = None,
               context_shift=None) -> Iterator[StreamEvent]:
        """See ``EngineProtocol.stream``. ``processors``: logits processors (generate.py) applied
        after the penalties; ``logprobs``: attach each token's logprob and that many
        alternatives to its TokenEvent; ``context_shift`` (``generate.ContextShift``): go on
        past a full context by dropping old tokens, as llama.cpp's ``--context-shift``."""
        import time

        from .generate import Uniforms, generate, token_logprobs

        prompt_ids = list(prompt_ids)
        self.check_fits(len(prompt_ids))
        torch = self._torch
        rng = Uniforms(params.seed)
        # reuse the keys/values of the longest common prefix with the previous call, unless the
        # caller asked for a seed: prefilling a shorter suffix changes the logits in the last
        # bits, and the same request + seed must give the same text whatever ran before
        cached = 0
        for a, b in zip(self._cached_ids if params.seed is None else (), prompt_ids[:-1]):
            if a != b:
                break
            cached += 1
        self._cached_ids = prompt_ids[:cached]
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.eos_ids
        limit = self.n_ctx - len(prompt_ids) if context_shift is None else float("inf")
        if params.max_tokens >= 0:
            limit = min(limit, params.max_tokens)
        decoder = self.tokenizer.decoder()
        stopper = StopStrings(params.stop)
        n_out, reason = 0, "length"
        t0 = time.perf_counter()
        t_first = None
        seen: list[tuple[float, tuple[tuple[int, float], ...]]] = []

        def observe(logits, tok: int) -> None:
            lp, top_lp, top_ids = token_logprobs(
                logits.view(1, -1), torch.tensor([tok]), logprobs or 0)
            alts = () if top_ids is None else tuple(zip(top_ids[0].tolist(), top_lp[0].tolist()))
            seen.append((float(lp[0]), alts))

        def on_shift(keep: int, discard: int) -> None:  # the cache dropped these tokens
            del self._cached_ids[keep:keep + discard]

        gen = generate(self.model, prompt_ids, params, self._cache, rng, cached, stop_ids,
                       processors, observe if logprobs is not None else None,
                       context_shift, self.tokenizer.bos_id, on_shift)
        appended = 0
        try:
            with torch.inference_mode():
                while n_out < limit:
                    if cancel is not None and cancel.is_set():
                        reason = "cancelled"
                        break
                    tok = next(gen, None)
                    if tok is None:  # the context is full and cannot shift
                        break
                    if t_first is None:
                        t_first = time.perf_counter()
                        self._cached_ids = list(prompt_ids)
                    n_out += 1
                    if tok in stop_ids:
                        reason = "stop"
                        break
                    self._cached_ids.append(tok)
                    appended += 1
                    text, hit = stopper.push(decoder.push(tok))
                    if seen:
                        lp, alts = seen.pop()
                        yield TokenEvent(tok, text, lp, alts)
                    else:
                        yield TokenEvent(tok, text)
                    if hit:
                        reason = "stop_string"
                        break
                if reason != "stop_string":  # emit what the decoder and stop filter held back
                    text, _ = stopper.push(decoder.flush(), final=True)
                    if text:
                        yield TokenEvent(-1, text)
                else:
                    reason = "stop"
        finally:
            gen.close()
            # the last sampled token was never run through the model: drop it from the prefix
            if appended:
                self._cached_ids.pop()
        t_end = time.perf_counter()
        t_first = t_first or t_end
        yield FinishEvent(reason, len(prompt_ids), n_out, t_first - t0, t_end - t_first,
                          stopper.hit)


class StopStrings:
    """Holds back text that might be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.hit: str | None = None  # the stop string that ended the text, once one has

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.hit = min(found, key=lambda f: f[0])
            out, self.pending = self.pending[:cut], ""
            return out, True
        if final:
            out, self.pending = self.pending, ""
            return out, False
        keep = 0  # longest suffix of pending that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False


def set_threads(n: int) -> None:
    """Use ``n`` threads for torch, the numba kernels and the C kernels (``sparseinfer.cpu``)."""
    import torch

    from .cpu import loads as cpu_loads
    from .threads import request_kernel_threads

    if n < 1:
        raise SparseInferError(f"threads: expected a positive number, got {n}")
    torch.set_num_threads(n)
    request_kernel_threads(n)  # numba's kernels: now if imported, else when first imported
    if cpu_loads():
        from . import cpu

        cpu.set_threads(n)
