"""One decode step for several sequences at once (continuous batching).

``Transformer.forward`` places a whole batch at one position; here every row has its own. The
sequences live in slots of one ``KVCache`` (batch = number of slots): row i of the step is
sequence ``slots[i]`` at position ``positions[i]``. The step calls the blocks' own modules
(norms, ``attn.wqkv``, ``attn.wo``, ``ffn``, whatever kernels or quantized weights they hold)
with the B rows stacked, so each weight is read once per step; only the attention is
per sequence (each row attends to its own slot up to its own position, by a length mask).

``slot_cache`` gives a one-sequence view of a slot, for prefilling a prompt into it with the
ordinary ``Transformer.forward``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import KVCache, Transformer, apply_rope


class SlotCache(KVCache):
    """A batch-1 view of slot ``slot`` of ``cache`` (writes go to the shared tensors)."""

    def __init__(self, cache: KVCache, slot: int):  # no super().__init__: nothing to allocate
        self.k = cache.k[:, slot : slot + 1]
        self.v = cache.v[:, slot : slot + 1]
        self.max_seq = cache.max_seq


def slot_cache(cache: KVCache, slot: int) -> SlotCache:
    if not 0 <= slot < cache.k.shape[1]:
        raise ValueError(f"slot: expected 0 <= slot < {cache.k.shape[1]}, got {slot}")
    return SlotCache(cache, slot)


def decode_step(model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
                slots: Tensor) -> Tensor:
    """Logits (B, V) in float32 for ``tokens`` (B,) at ``positions`` (B,) of cache ``slots`` (B,);
    each row's key/value is written into its slot at its position."""
    cfg = model.cfg
    B = tokens.shape[0]
    first = int(slots[0])
    run = slots.tolist() == list(range(first, first + B))  # consecutive slots: slice, no gather
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    group = nh // nkv
    if int(positions.max()) >= cache.max_seq:
        raise ValueError(f"positions up to {int(positions.max())} exceed the cache size "
                         f"{cache.max_seq}")
    S = int(positions.max()) + 1  # keys to look at: the longest sequence's
    x = model.tok_emb(tokens.to(model.device))  # (B, D)
    if model.pos_emb is not None:
        x = x + model.pos_emb.weight[cfg.pos_offset + positions]
    if model.rope is not None:
        cos, sin = model.rope[0][positions].unsqueeze(1), model.rope[1][positions].unsqueeze(1)
    # row i sees keys 0..positions[i]: (B, 1, 1, S)
    hidden = (torch.arange(S).view(1, S) > positions.view(B, 1)).view(B, 1, 1, S)
    for layer, block in enumerate(model.layers):
        attn = block.attn
        h = block.attn_norm(x.view(B, 1, -1))  # (B, 1, D)
        q, k, v = attn.wqkv(h).view(B, -1).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(B, nh, hd), k.view(B, nkv, hd), v.view(B, nkv, hd)
        if model.rope is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[layer, slots, :, positions] = k.to(cache.k.dtype)  # (B, nkv, hd) into the slots
        cache.v[layer, slots, :, positions] = v.to(cache.v.dtype)
        if run:
            keys = cache.k[layer, first : first + B, :, :S]  # (B, nkv, S, hd), a view
            values = cache.v[layer, first : first + B, :, :S]
        else:  # gather only the first S positions of each slot
            keys = cache.k[layer, :, :, :S].index_select(0, slots)
            values = cache.v[layer, :, :, :S].index_select(0, slots)
        qg = q.view(B, nkv, group, hd)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * attn.scale  # (B, nkv, group, S)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).reshape(B, 1, nh * hd)  # (B, 1, nh*hd)
        x = x + attn.wo(out).view(B, -1)
        x = x + block.ffn(block.ffn_norm(x.view(B, 1, -1))).view(B, -1)
    h = model.norm(x)
    if B == 1:  # a module may take another kernel for a lone row (Int8Linear's fp32 GEMV):
        h = h.expand(2, -1)  # two rows keep a sequence's numbers independent of the batch
    return model.lm_head(h).float()[:B]  # (B, V)
