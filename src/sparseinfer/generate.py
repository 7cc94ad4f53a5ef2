"""Prefill, decode and sampling as small pure functions; ``generate`` is a generator of token ids."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .config import SamplingParams
from .cpu import loads as cpu_loads
from .models.model import KVCache, Transformer

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # tokens per forward pass during prefill (bounds the attention scratch)

# A logits processor sees the ids generated so far (not the prompt) and the next token's logits
# (V,) and returns the logits to sample from (logit_bias, a grammar's mask...).
LogitsProcessor = Callable[[Sequence[int], Tensor], Tensor]


def apply_penalties(logits: Tensor, history: Sequence[int], p: SamplingParams) -> Tensor:
    """llama.cpp repeat penalty over the last ``repeat_last_n`` tokens, then OpenAI
    presence/frequency penalties over the whole history. Returns a new tensor."""
    if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                       and p.frequency_penalty == 0.0):
        return logits
    logits = logits.clone()
    if p.repeat_penalty != 1.0 and p.repeat_last_n != 0:
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
        ids = torch.tensor(sorted(set(window)), dtype=torch.long)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        ids, counts = torch.tensor(history, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= counts.to(logits.dtype) * p.frequency_penalty + p.presence_penalty
    return logits


class Uniforms:
    """One sequence's uniform draws in [0, 1) for ``sample``: a torch generator seeded with
    ``seed`` (or from the OS when None), read a block at a time. Each torch call releases the GIL,
    and a thread that gives the GIL up waits out every other Python thread's turn before it runs
    again — per token, in a server whose request threads and event loop run beside the loop that
    samples every stream (benchmarks/RESULTS.md); a block costs that once per ``BLOCK`` tokens."""

    BLOCK = 64

    def __init__(self, seed: int | None = None) -> None:
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(6), "little"))
        self._ahead: list[float] = []

    def __call__(self) -> float:
        if not self._ahead:
            self._ahead = torch.rand(self.BLOCK, generator=self._gen, dtype=torch.float64).tolist()
            self._ahead.reverse()
        return self._ahead.pop()


def _c_vector(logits: Tensor) -> bool:
    """A contiguous float32 CPU vector, the C library loaded: what its top-k and sampler take."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and cpu_loads())


def sample(logits: Tensor, p: SamplingParams, rng: Uniforms | None) -> int:
    """Pick the next token from 1-D float logits: greedy when temperature <= 0 (or too small for
    float32 to divide by), else top-k -> top-p -> min-p -> temperature -> draw (llama.cpp's
    order), the draw one uniform from ``rng``. With top-k on a float32 CPU vector the chain after
    the uniform is one C call (``cpu.sample_topk``; the numpy and torch calls it replaces cost a
    few times the top-k itself, once per token and sequence: benchmarks/RESULTS.md);
    ``sample_ref`` is the same chain in numpy, its reference. ``rng`` None: torch's global
    generator."""
    if p.temperature < torch.finfo(torch.float32).tiny:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return int(logits.numpy().argmax())  # same first-maximum rule, ~20x faster
        return int(torch.argmax(logits))
    u = rng() if rng is not None else float(torch.rand((), dtype=torch.float64))
    if 0 < p.top_k < logits.numel() and _c_vector(logits):
        from . import cpu

        return cpu.sample_topk(logits, p.top_k, p.top_p, p.min_p, p.temperature, u)
    return sample_ref(logits, p, u)


def sample_ref(logits: Tensor, p: SamplingParams, u: float) -> int:
    """``sample``'s chain for temperature > 0 given its uniform ``u`` in [0, 1): a stable sort of
    the logits in torch, then numpy (float64) over the candidates. The reference of
    ``cpu.sample_topk``, and the path without a top-k or off the CPU."""
    vals, ids = torch.sort(logits, descending=True, stable=True)  # equal logits lower id first,
    if 0 < p.top_k < logits.numel():                                 # as cpu.topk takes them
        vals, ids = vals[: p.top_k], ids[: p.top_k]
    v = vals.detach().to("cpu", torch.float64).numpy()
    probs = np.exp(v - v[0])  # softmax of the candidates (the best first)
    probs /= probs.sum()
    keep = len(v)
    if p.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
    # the best logit shifted to 0 before dividing: a tiny temperature then sends the others to
    # weight 0 (greedy) instead of overflowing every logit to inf
    cum = np.cumsum(np.exp((v[:keep] - v[0]) / p.temperature))
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), keep - 1)])


def prefill(model: Transformer, ids: Sequence[int], pos: int, cache: KVCache) -> Tensor:
    """Run ``ids`` into the cache from position ``pos``; returns the last position's logits (V,)."""
    logits = None
    for start in range(0, len(ids), PREFILL_CHUNK):
        chunk = torch.tensor([ids[start:start + PREFILL_CHUNK]], dtype=torch.long)
        logits = model(chunk, pos + start, cache, last_only=True)
    assert logits is not None, "prefill needs at least one token"
    return logits[0, -1]


def token_logprobs(logits: Tensor, targets: Tensor, top: int = 0
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Log-probabilities of ``targets`` (T,) under ``logits`` (T, V), and the ``top`` best
    alternatives of each row: (lp (T,), top_lp (T, top) | None, top_ids (T, top) | None)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets.view(-1, 1)).view(-1)
    if top <= 0:
        return lp, None, None
    top_lp, top_ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    return lp, top_lp, top_ids


def score(model: Transformer, ids: Sequence[int], cache: KVCache, top: int = 0
          ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Teacher-forced log-probabilities of ``ids[1:]`` (each given the tokens before it), run from
    position 0 into ``cache`` in PREFILL_CHUNK pieces; see ``token_logprobs`` for the result."""
    rows = []
    for start in range(0, len(ids) - 1, PREFILL_CHUNK):
        chunk = torch.tensor([ids[start:start + PREFILL_CHUNK]], dtype=torch.long)
        rows.append(model(chunk, start, cache)[0])  # (T, V): the next token's logits per position
    logits = torch.cat(rows)[: len(ids) - 1] if rows else torch.empty(0, model.cfg.vocab_size)
    return token_logprobs(logits, torch.tensor(list(ids[1:]), dtype=torch.long), top)


# how one vector is made of a text's final-normed hidden states (T, D): llama.cpp's --pooling
POOLINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": lambda h: h.mean(0),  # every token's (the BOS included, as llama.cpp's)
    "last": lambda h: h[-1],  # the last token's, which has seen the whole text
}


def embedding(model: Transformer, ids: Sequence[int], cache: KVCache, pooling: str = "mean"
              ) -> Tensor:
    """The text ``ids`` as one float32 vector (D,) of unit length (llama.cpp's default
    normalization): its final-normed hidden states, run from position 0 into ``cache`` in
    PREFILL_CHUNK pieces, pooled by ``POOLINGS[pooling]``."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {sorted(POOLINGS)}, got {pooling!r}")
    if not ids:
        raise ValueError("embedding: expected at least one token, got none")
    rows = []
    for start in range(0, len(ids), PREFILL_CHUNK):
        chunk = torch.tensor([ids[start:start + PREFILL_CHUNK]], dtype=torch.long)
        rows.append(model.hidden(chunk, start, cache)[0].float())
    return torch.nn.functional.normalize(POOLINGS[pooling](torch.cat(rows)), dim=0)


@dataclass(frozen=True)
class ContextShift:
    """llama.cpp's context shift (``--context-shift``, ``--keep N``): when the cache is full,
    keep the first ``keep`` tokens, discard half of the rest (the oldest) and go on.

    ``keep`` counts prompt tokens as llama.cpp's ``n_keep`` does: -1 (or more than the prompt)
    keeps the whole prompt; otherwise the BOS token, when the prompt starts with one, comes on
    top (``n_keep += add_bos``).

    How the kept keys and values get to their new positions:
    - ``recompute=False`` (llama.cpp's way, the default): keys are rotated back by the number
      of dropped tokens (``Transformer.shift_cache``); values stay. Instant, but the kept
      tokens' keys and values above the first layer still carry what they saw of the dropped
      tokens, so the next logits are not those of a fresh run over the kept text.
    - ``recompute=True``: the kept tokens are run again from position 0 (one batched prefill
      of about half the context per shift): the next logits equal a fresh run's.
    Models with learned positions always recompute."""

    keep: int = 0
    recompute: bool = False

    def n_keep(self, prompt: Sequence[int], bos_id: int | None) -> int:
        if self.keep < 0 or self.keep > len(prompt):
            return len(prompt)
        has_bos = bos_id is not None and len(prompt) > 0 and prompt[0] == bos_id
        return min(self.keep + int(has_bos), len(prompt))


def shift_context(model: Transformer, cache: KVCache, in_cache: list[int], n_keep: int,
                  recompute: bool = False) -> int:
    """Make room in a full cache holding ``in_cache``: drop the ``(len - n_keep) // 2`` tokens
    after the first ``n_keep`` (llama.cpp's ``n_discard = n_left / 2``) and move the rest down,
    rotating the kept keys or recomputing them (``ContextShift``). Updates ``in_cache`` and
    returns how many tokens were discarded (0: nothing can go)."""
    n_past = len(in_cache)
    discard = (n_past - n_keep) // 2
    if discard < 1:
        return 0
    log.info("context full, shifting: n_past = %d, n_keep = %d, n_discard = %d (%s)",
             n_past, n_keep, discard, "recompute" if recompute else "rotate keys")
    del in_cache[n_keep:n_keep + discard]
    if model.can_shift and not recompute:
        model.shift_cache(cache, n_keep, discard, n_past)
    else:
        prefill(model, in_cache, 0, cache)
    return discard


def generate(model: Transformer, prompt: Sequence[int], params: SamplingParams, cache: KVCache,
             rng: Uniforms | None = None, cached: int = 0,
             stop_ids: frozenset[int] = frozenset(),
             processors: Sequence[LogitsProcessor] = (),
             observe: Callable[[Tensor, int], None] | None = None,
             context_shift: ContextShift | None = None, bos_id: int | None = None,
             on_shift: Callable[[int, int], None] | None = None) -> Iterator[int]:
    """Yield sampled token ids after ``prompt`` until a stop id (yielded) or the cache is full.

    ``cached`` prompt tokens are already in the cache (a shared prefix from an earlier call).
    ``processors`` rewrite the logits after the penalties; ``observe(logits, token)`` sees the
    logits each token was sampled from (for logprobs). The caller stops iterating for
    ``max_tokens`` and stop strings. With ``context_shift`` a full cache is shifted
    (``shift_context``; ``bos_id`` for its ``n_keep``) and generation goes on; ``on_shift(keep,
    discard)`` hears of each shift.
    """
    history = list(prompt)
    logits = prefill(model, prompt[cached:], cached, cache)  # 1. fill the cache with the prompt
    in_cache = list(prompt)  # the tokens whose keys/values the cache holds, in order
    n_keep = context_shift.n_keep(prompt, bos_id) if context_shift is not None else 0
    pos = len(prompt)
    while True:
        logits = apply_penalties(logits, history, params)  # 2. penalise repeats
        for proc in processors:  # 3. bias / constrain
            logits = proc(history[len(prompt):], logits)
        tok = sample(logits, params, rng)  # 4. pick the next token
        if observe is not None:
            observe(logits, tok)
        yield tok
        if tok in stop_ids:
            return
        if pos >= cache.max_seq:  # 5. the cache is full: stop, or shift it (llama.cpp)
            discard = 0 if context_shift is None else shift_context(
                model, cache, in_cache, n_keep, context_shift.recompute)
            if discard == 0:
                return
            pos -= discard
            if on_shift is not None:
                on_shift(n_keep, discard)
        history.append(tok)
        in_cache.append(tok)
        x = torch.tensor([[tok]], dtype=torch.long)  # 6. run it through the model
        logits = model(x, pos, cache, last_only=True)[0, -1]
        pos += 1
