"""One decode step for several sequences at once (continuous batching).

``Transformer.forward`` places a whole batch at one position; here every row has its own. The
sequences live in slots of one ``KVCache`` (batch = number of slots): row i of the step is
sequence ``slots[i]`` at position ``positions[i]``. The step runs the model's own blocks with a
``Rows`` description in place of the position: norms, projections and FFNs (whatever kernels or
quantized weights they hold) see the B rows stacked, so each weight is read once per step; only
the attention is per sequence (``Attention.attend_rows``: each row attends to its own slot up to
its own position, with the layer's q/k norms, window, soft-capping and scale).

``slot_cache`` gives a one-sequence view of a slot, for prefilling a prompt into it with the
ordinary ``Transformer.forward``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import KVCache, Rows, Transformer


class SlotCache(KVCache):
    """A batch-1 view of slot ``slot`` of ``cache`` (writes go to the shared tensors)."""

    def __init__(self, cache: KVCache, slot: int):  # no super().__init__: nothing to allocate
        self.k = cache.k[:, slot : slot + 1]
        self.v = cache.v[:, slot : slot + 1]
        self.max_seq = cache.max_seq
        self.k_np = None if cache.k_np is None else cache.k_np[:, slot : slot + 1]
        self.v_np = None if cache.v_np is None else cache.v_np[:, slot : slot + 1]


def slot_cache(cache: KVCache, slot: int) -> SlotCache:
    if not 0 <= slot < cache.k.shape[1]:
        raise ValueError(f"slot: expected 0 <= slot < {cache.k.shape[1]}, got {slot}")
    return SlotCache(cache, slot)


def decode_step(model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
                slots: Tensor, kernel=None, logit_rows: Tensor | None = None) -> Tensor:
    """Logits (B, V) in float32 for ``tokens`` (B,) at ``positions`` (B,) of cache ``slots`` (B,);
    each row's key/value is written into its slot at its position. The model's own blocks run
    with ``Rows`` in place of a position (every architecture the model file has); ``kernel``
    is ``Rows.kernel``: a per-row attention for plain layers (``fused.decode.attend_rows``), or
    None for the torch one (``Attention.attend_rows``).

    Several rows may be one sequence at consecutive positions (a prompt chunk riding along with
    the decoding rows, in position order; the chunks of several prompts each in its own slot):
    every row's key and value are in the cache before any row attends, and each row sees its
    slot only up to its own position. ``logit_rows`` (R,):
    the rows whose logits are wanted (the others skip the output head); returns (R, V)."""
    B = tokens.shape[0]
    if int(positions.max()) >= cache.max_seq:
        raise ValueError(f"positions up to {int(positions.max())} exceed the cache size "
                         f"{cache.max_seq}")
    rows = Rows(positions, slots, kernel)
    x = model.embed(tokens.to(model.device).view(B, 1), rows)  # (B, 1, D)
    h = model.blocks(x, rows, cache).view(B, -1)  # (B, D)
    if logit_rows is not None:
        h = h[logit_rows.to(h.device)]
        B = h.shape[0]
        if B == 0:  # no row picks a token (a prompt chunk that does not end its prompt)
            return h.new_empty(0, model.cfg.vocab_size, dtype=torch.float32)
    head = getattr(model.lm_head, "forward_rows", None)  # a kernel made for a few rows
    if head is not None:
        return model.finish_logits(head(h).float())  # (B, V)
    if B == 1:  # a module may take another kernel for a lone row (Int8Linear's fp32 GEMV):
        h = h.expand(2, -1)  # two rows keep a sequence's numbers independent of the batch
    return model.finish_logits(model.lm_head(h).float()[:B])  # (B, V)
