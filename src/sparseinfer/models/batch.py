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
        self.k_np = None if cache.k_np is None else cache.k_np[:, slot : slot + 1]
        self.v_np = None if cache.v_np is None else cache.v_np[:, slot : slot + 1]


def slot_cache(cache: KVCache, slot: int) -> SlotCache:
    if not 0 <= slot < cache.k.shape[1]:
        raise ValueError(f"slot: expected 0 <= slot < {cache.k.shape[1]}, got {slot}")
    return SlotCache(cache, slot)


def attend(model: Transformer, layer: int, qkv: Tensor, positions: Tensor, cache: KVCache,
           slots: Tensor) -> Tensor:
    """Rope, the cache write and attention for each row of ``qkv`` (B, (nh + 2 nkv) hd): row i
    is slot ``slots[i]`` at ``positions[i]`` and attends to that slot's keys 0..positions[i].
    Returns (B, nh hd). The torch reference (``decode_step``'s default ``attend``)."""
    cfg = model.cfg
    B = qkv.shape[0]
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    group = nh // nkv
    S = int(positions.max()) + 1  # keys to look at: the longest sequence's
    first = int(slots[0])
    run = slots.tolist() == list(range(first, first + B))  # consecutive slots: slice, no gather
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.reshape(B, nh, hd), k.reshape(B, nkv, hd), v.reshape(B, nkv, hd)
    if model.rope is not None:
        cos, sin = model.rope[0][positions].unsqueeze(1), model.rope[1][positions].unsqueeze(1)
        il = cfg.rope_interleaved
        q, k = apply_rope(q, cos, sin, il), apply_rope(k, cos, sin, il)
    cache.k[layer, slots, :, positions] = k.to(cache.k.dtype)  # (B, nkv, hd) into the slots
    cache.v[layer, slots, :, positions] = v.to(cache.v.dtype)
    if run:
        keys = cache.k[layer, first : first + B, :, :S]  # (B, nkv, S, hd), a view
        values = cache.v[layer, first : first + B, :, :S]
    else:  # gather only the first S positions of each slot
        keys = cache.k[layer, :, :, :S].index_select(0, slots)
        values = cache.v[layer, :, :, :S].index_select(0, slots)
    hidden = (torch.arange(S).view(1, S) > positions.view(B, 1)).view(B, 1, 1, S)
    qg = q.view(B, nkv, group, hd)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * model.layers[layer].attn.scale
    scores = scores.masked_fill(hidden, float("-inf"))  # (B, nkv, group, S)
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(B, nh * hd)


def decode_step(model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
                slots: Tensor, attend_rows=attend) -> Tensor:
    """Logits (B, V) in float32 for ``tokens`` (B,) at ``positions`` (B,) of cache ``slots`` (B,);
    each row's key/value is written into its slot at its position. ``attend_rows`` has
    ``attend``'s signature (``fused.decode.attend_rows`` runs the fused kernel per row)."""
    cfg = model.cfg
    B = tokens.shape[0]
    if not cfg.plain_block:
        raise ValueError(f"continuous batching runs pre-norm attention + FFN blocks only; "
                         f"{cfg.name or cfg.arch} has q/k norms, windows, soft-capping, "
                         f"post-norms or parallel blocks: serve it with --parallel 1")
    if int(positions.max()) >= cache.max_seq:
        raise ValueError(f"positions up to {int(positions.max())} exceed the cache size "
                         f"{cache.max_seq}")
    x = model.tok_emb(tokens.to(model.device))  # (B, D)
    if model.pos_emb is not None:
        x = x + model.pos_emb.weight[cfg.pos_offset + positions]
    for layer, block in enumerate(model.layers):
        h = block.attn_norm(x.view(B, 1, -1))  # (B, 1, D)
        out = attend_rows(model, layer, block.attn.wqkv(h).view(B, -1), positions, cache, slots)
        x = x + block.attn.wo(out.view(B, 1, -1)).view(B, -1)
        r = x.view(B, 1, -1)
        x = x + block.ffn(block.ffn_norm(r), r).view(B, -1)
    h = model.norm(x)
    rows = getattr(model.lm_head, "forward_rows", None)  # a kernel made for a few rows
    if rows is not None:
        return rows(h).float()  # (B, V)
    if B == 1:  # a module may take another kernel for a lone row (Int8Linear's fp32 GEMV):
        h = h.expand(2, -1)  # two rows keep a sequence's numbers independent of the batch
    return model.lm_head(h).float()[:B]  # (B, V)
