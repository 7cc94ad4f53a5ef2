"""Prefill, decode and sampling as small pure functions; ``generate`` is a generator of token ids."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .config import SamplingParams
from .models.model import KVCache, Transformer

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


def sample(logits: Tensor, p: SamplingParams, rng: torch.Generator | None) -> int:
    """Pick the next token from 1-D float logits: greedy when temperature <= 0 (or too small for
    float32 to divide by), else top-k -> top-p -> min-p -> temperature -> draw (llama.cpp's
    order)."""
    if p.temperature < torch.finfo(torch.float32).tiny:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return int(logits.numpy().argmax())  # same first-maximum rule, ~20x faster
        return int(torch.argmax(logits))
    if 0 < p.top_k < logits.numel():
        vals, ids = torch.topk(logits, p.top_k)
    else:
        vals, ids = torch.sort(logits, descending=True)
    probs = torch.softmax(vals, dim=-1)
    keep = probs.numel()
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(p.top_p))) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
    vals, ids = vals[:keep], ids[:keep]
    # shift the best logit to 0 before dividing: a tiny temperature then sends the others to
    # -inf (greedy) instead of overflowing every logit to inf (softmax -> nan)
    probs = torch.softmax((vals - vals[0]) / p.temperature, dim=-1)
    return int(ids[torch.multinomial(probs, 1, generator=rng)])


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


def generate(model: Transformer, prompt: Sequence[int], params: SamplingParams, cache: KVCache,
             rng: torch.Generator | None = None, cached: int = 0,
             stop_ids: frozenset[int] = frozenset(),
             processors: Sequence[LogitsProcessor] = (),
             observe: Callable[[Tensor, int], None] | None = None) -> Iterator[int]:
    """Yield sampled token ids after ``prompt`` until a stop id (yielded) or the cache is full.

    ``cached`` prompt tokens are already in the cache (a shared prefix from an earlier call).
    ``processors`` rewrite the logits after the penalties; ``observe(logits, token)`` sees the
    logits each token was sampled from (for logprobs). The caller stops iterating for
    ``max_tokens`` and stop strings.
    """
    history = list(prompt)
    logits = prefill(model, prompt[cached:], cached, cache)  # 1. fill the cache with the prompt
    pos = len(prompt)
    while True:
        logits = apply_penalties(logits, history, params)  # 2. penalise repeats
        for proc in processors:  # 3. bias / constrain
            logits = proc(history[len(prompt):], logits)
        tok = sample(logits, params, rng)  # 4. pick the next token
        if observe is not None:
            observe(logits, tok)
        yield tok
        if tok in stop_ids or pos >= cache.max_seq:
            return
        history.append(tok)
        x = torch.tensor([[tok]], dtype=torch.long)  # 5. run it through the model
        logits = model(x, pos, cache, last_only=True)[0, -1]
        pos += 1
