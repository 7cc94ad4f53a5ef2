"""llama.cpp-style chunked perplexity.

The text is tokenized once and cut into chunks of ``n_ctx`` tokens; the first token of a chunk is
replaced by BOS when the model adds one; only the second half of each chunk is scored (every
scored token sees at least n_ctx/2 tokens of context), as ``llama-perplexity`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import SparseInferError
from .models.model import Transformer


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll_sum: float
    n_scored: int
    n_chunks: int
    chunk_ppls: tuple[float, ...]


def perplexity(model: Transformer, tokens: Sequence[int], n_ctx: int, bos_id: int | None = None,
               max_chunks: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """Perplexity of ``tokens`` in chunks of ``n_ctx``; ``progress(done, total, running_ppl)``."""
    if n_ctx < 8:
        raise SparseInferError(f"context size: expected at least 8 tokens, got {n_ctx}")
    if n_ctx > model.cfg.max_seq_len:
        raise SparseInferError(f"context size {n_ctx} exceeds the model's maximum "
                               f"{model.cfg.max_seq_len}")
    n_chunks = len(tokens) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise SparseInferError(f"the text has {len(tokens)} tokens; perplexity needs at least "
                               f"one chunk of {n_ctx} (use a longer text or a smaller -c)")
    first = n_ctx // 2
    cache = model.new_cache(1, n_ctx)
    nll_sum, n_scored, chunk_ppls = 0.0, 0, []
    with torch.inference_mode():
        for c in range(n_chunks):
            chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
            if bos_id is not None:
                chunk[0] = bos_id
            x = torch.tensor([chunk], dtype=torch.long)
            logits = model(x, 0, cache)[0]  # (n_ctx, V)
            logp = torch.log_softmax(logits[first:-1].float(), dim=-1)
            target = x[0, first + 1:]
            nll = -logp.gather(1, target[:, None]).squeeze(1).double()
            nll_sum += float(nll.sum())
            n_scored += nll.numel()
            chunk_ppls.append(math.exp(float(nll.mean())))
            if progress:
                progress(c + 1, n_chunks, math.exp(nll_sum / n_scored))
    return PerplexityResult(math.exp(nll_sum / n_scored), nll_sum, n_scored, n_chunks,
                            tuple(chunk_ppls))
