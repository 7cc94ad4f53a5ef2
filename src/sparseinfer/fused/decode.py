"""Fused single-token decode: the non-matmul work of a llama block in two numba calls.

For one token the projections are a few dozen microseconds each, and the dozens of small torch
ops around them (norm, rope, cache writes, grouped-query attention, residual adds, each ≈2–3 µs
of dispatch) cost as much again. ``FusedDecode`` keeps the block's own projection modules
(``FloatLinear``, the file's blocks in ``GGMLLinear``, 4-bit ``Int4Linear``, or whatever the FFN
is, sparse included) and replaces the rest for B = T = 1 (``Block.fused``, chosen by the load
plan) by:

- ``rms_norm`` — ``out = x · rsqrt(mean(x²) + eps) · w`` (optionally ``x += add`` first, the
  residual), and
- ``attend`` — rope (rotate-half, or adjacent pairs for GGUF's Q/K order) on q and k, the new k/v written into the cache at ``pos``,
  softmax(q·Kᵀ · scale) · V per head with grouped K/V heads.

When the block's weights are on the C kernels (``GGMLLinear``, or fp32 ``FloatLinear``) and its
FFN is dense, or sparse with rows and a float16 predictor the C kernels take
(``SparseFFN.c_block_ffn``), the whole block is one call into the C library instead
(``sparseinfer.cpu.DecodeBlock``: the same steps, the products, the predictor and the neuron
rows on its thread pool with no Python between them). That block also takes one token of each
of several sequences (continuous batching: ``Rows``, ``FusedDecode.rows``) in one call, the
weights read once for all of them.

Everything else (prompts, batches, LayerNorm models, learned positions, non-CPU or non-fp32
models) runs the block's torch code unchanged. ``rms_norm_ref`` / ``attend_ref`` are the plain
torch references the tests compare the kernels with; whole blocks are compared with
``Block``'s torch path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..models.model import Block, KVCache, Rows, apply_rope


def _rms_norm(*args):  # numba's kernel (fused/kernels.py), bound on first use
    from .kernels import rms_norm_kernel  # numba is imported only if this path runs

    globals()["_rms_norm"] = rms_norm_kernel
    return rms_norm_kernel(*args)


def _attend(*args):  # likewise
    from .kernels import attend_kernel

    globals()["_attend"] = attend_kernel
    return attend_kernel(*args)


def rms_norm_ref(x: Tensor, add: Tensor | None, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(new residual, normed) for 1-D ``x``."""
    x = x + add if add is not None else x
    return x, x * torch.rsqrt(x.pow(2).mean() + eps) * w


def attend_ref(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int, cos: Tensor, sin: Tensor,
               nh: int, nkv: int, interleaved: bool = False) -> Tensor:
    """One token's attention output (nh · hd,); writes its k/v into the (nkv, S, hd) caches."""
    hd = k_cache.shape[-1]
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd])
    q = apply_rope(q.view(nh, 1, hd), cos, sin, interleaved)
    k = apply_rope(k.view(nkv, 1, hd), cos, sin, interleaved)
    k_cache[:, pos] = k[:, 0]
    v_cache[:, pos] = v.view(nkv, hd)
    keys, values = k_cache[:, :pos + 1].to(q.dtype), v_cache[:, :pos + 1].to(q.dtype)
    group = nh // nkv
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    probs = torch.softmax((q @ keys.transpose(-1, -2)) / math.sqrt(hd), dim=-1)
    return (probs @ values).reshape(nh * hd)


# ---- kernels with the references' signatures ----------------------------------------------------

_EMPTY = np.zeros(0, dtype=np.float32)


def rms_norm(x: Tensor, add: Tensor | None, w: Tensor, eps: float, out: Tensor) -> Tensor:
    """In place: ``x += add`` (when given), ``out = rmsnorm(x) · w``; fp32 contiguous 1-D."""
    _rms_norm(x.numpy(), _EMPTY if add is None else add.numpy(), w.numpy(), eps, out.numpy())
    return out


def attend(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int, cos: Tensor, sin: Tensor,
           nh: int, nkv: int, scores: Tensor, out: Tensor, interleaved: bool = False) -> Tensor:
    """``attend_ref`` as one kernel call (``qkv`` is rotated in place; ``scores`` is scratch of at
    least pos + 1 floats)."""
    _attend(qkv.numpy(), k_cache.numpy(), v_cache.numpy(), pos, cos.numpy(), sin.numpy(), nh, nkv,
            np.float32(1.0 / math.sqrt(k_cache.shape[-1])), scores.numpy(), out.numpy(),
            interleaved)
    return out


# ---- the block ---------------------------------------------------------------------------------


def rope_pointers(rope, hd: int) -> tuple[int, int, int]:
    """(cos, sin, positions) of rope tables ``rope`` for the C kernels, which read them by
    address: contiguous float32 [S, hd] alike, else ValueError."""
    cos, sin = rope
    if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
            and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[-1] == hd):
        raise ValueError(f"rope tables: expected contiguous float32 [S, {hd}], got "
                         f"{cos.dtype} {list(cos.shape)}")
    return cos.data_ptr(), sin.data_ptr(), cos.shape[0]


def check_rope_room(last: int, n_rope: int) -> None:
    """ValueError unless position ``last`` has a row in rope tables of ``n_rope`` positions."""
    if last >= n_rope:
        raise ValueError(f"position {last} is past the rope tables ({n_rope} positions)")


class FusedDecode:
    """A block's single-token decode with ``rms_norm`` and ``attend`` around its own projection
    modules. Chosen when the model is built (``Block.fused``, for CPU fp32 RMSNorm/RoPE models);
    on the first call it looks up the block's (by then filled) modules once and calls their
    ``forward`` directly (no hook dispatch: ≈1 µs each). KV-cache views come from the cache
    object itself (``KVCache.k_np``), so a new cache is never confused with a freed one."""

    def __init__(self, block: Block, c_block: bool = True):
        self._block = [block]  # a list: not registered as a submodule (no recursion in repr)
        self._want_c = c_block  # False: always the numba kernels (benchmarks compare the two)
        self._ready = False

    def __repr__(self) -> str:
        return "FusedDecode(one C call per block, or rms_norm + attend kernels)"

    def _prepare(self, layer: int) -> None:
        block = self._block[0]
        cfg = block.attn.cfg
        self.nh, self.nkv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.interleaved = bool(cfg.rope_interleaved)
        self.eps = float(block.attn_norm.eps)
        self.scale = np.float32(1.0 / math.sqrt(self.hd))
        self.wqkv, self.wo = block.attn.wqkv.forward, block.attn.wo.forward
        self.ffn = block.ffn
        self.w_attn = block.attn_norm.weight.detach().numpy()
        self.w_ffn = block.ffn_norm.weight.detach().numpy()
        self._h = torch.empty(cfg.d_model)
        self._hn = self._h.numpy()
        self._o = torch.empty(self.nh * self.hd)
        self._on = self._o.numpy()
        self._scores = np.empty(cfg.max_seq_len, dtype=np.float32)
        self._rope_key = None  # the tables self._cos/self._sin view (numba's path)
        self._ptrs_key = None  # the tables self._rope_ptrs address (the C calls)
        self._c = _c_block(block, layer) if self._want_c else None
        # the C block computes the attention only: the block's norm and FFN module follow
        self.attn_only = self._c is not None and self._c.attn_only
        self.ffn_norm = block.ffn_norm
        self.scaled = block.scaled  # the FFN's output as its residual add takes it (Granite)
        self._attend_c = None  # a float16 cache's attention (numba reads float32 only), in C
        if self._c is None and not cfg.plain_block:  # the plan fuses such blocks only for C
            raise RuntimeError(f"fused decode of a {cfg.arch} block (q/k norms, post-norms, "
                               "windows, a custom scale or residual multiplier) needs the C "
                               "block: expected its four products on the C kernels")
        self._ready = True

    def __call__(self, x: Tensor, layer: int, pos: int, cache: KVCache, rope) -> Tensor:
        if not self._ready:
            self._prepare(layer)
        if self._c is not None:
            return self._c_call(x, layer, pos, cache, rope)
        kv16 = cache.k_np is None  # a float16 cache: the C attention (numba reads float32 only)
        if not kv16:
            kc, vc = cache.k_np[layer, 0], cache.v_np[layer, 0]
        if self._scores.shape[0] < cache.max_seq:
            self._scores = np.empty(cache.max_seq, dtype=np.float32)
        if not kv16 and self._rope_key is not rope[0]:
            self._cos, self._sin = rope[0].numpy(), rope[1].numpy()
            self._rope_key = rope[0]
        x1 = x.reshape(-1).clone()  # the residual stream, updated in place below
        xn = x1.numpy()
        _rms_norm(xn, _EMPTY, self.w_attn, self.eps, self._hn)
        qkv = self.wqkv(self._h).reshape(-1)
        if not qkv.is_contiguous():
            qkv = qkv.contiguous()
        if kv16:
            if self._attend_c is None:
                from .. import cpu

                self._attend_c = cpu.attend_token_raw
            cos_p, sin_p, n_rope = self._rope_addresses(rope)
            check_rope_room(pos, n_rope)
            k, v, _ = self._layer_cache(cache, layer)
            ro = pos * self.hd * 4
            self._attend_c(qkv.data_ptr(), k, v, True, pos, cos_p + ro, sin_p + ro, self.nh,
                           self.nkv, self.hd, cache.max_seq, self.interleaved,
                           float(self.scale), self._o.data_ptr())
        else:
            _attend(qkv.numpy(), kc, vc, pos, self._cos[pos], self._sin[pos], self.nh,
                    self.nkv, self.scale, self._scores, self._on, self.interleaved)
        a = self.wo(self._o).reshape(-1)
        _rms_norm(xn, a.numpy(), self.w_ffn, self.eps, self._hn)
        y = self.ffn(self._h.view(1, 1, -1), x1.view(1, 1, -1))
        x1 += y.reshape(-1)
        return x1.view(1, 1, -1)

    def takes_rows(self, layer: int) -> bool:
        """Whether several sequences' tokens (``Rows``) go through ``rows``: when the block is on
        the C library; else the block's own torch code runs them."""
        if not self._ready:
            self._prepare(layer)
        return self._c is not None

    def _rope_addresses(self, rope) -> tuple[int, int, int]:
        """``rope_pointers`` of the rope tables, checked once per table."""
        if self._ptrs_key is not rope[0]:
            self._rope_ptrs = rope_pointers(rope, self.hd)
            self._ptrs_key = rope[0]
        return self._rope_ptrs

    @staticmethod
    def _layer_cache(cache: KVCache, layer: int) -> tuple[int, int, bool]:
        """Addresses of ``layer``'s keys and values, slot 0 ((L, slots, nkv, S, hd) float32 or
        float16), and whether they are float16."""
        k, v = cache.k, cache.v
        if k.device.type != "cpu" or k.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the fused decode needs a float32 or float16 CPU KV cache, got "
                             f"{k.dtype} on {k.device}")
        off = layer * k.stride(0) * k.element_size()
        return k.data_ptr() + off, v.data_ptr() + off, k.dtype == torch.float16

    def _c_call(self, x: Tensor, layer: int, pos: int, cache: KVCache, rope) -> Tensor:
        """The whole block in one C call (``sparseinfer.cpu.DecodeBlock``)."""
        cos_p, sin_p, n_rope = self._rope_addresses(rope)
        check_rope_room(pos, n_rope)
        k, v, kv16 = self._layer_cache(cache, layer)
        ro = pos * self.hd * 4
        x1 = x.reshape(-1).clone()  # the residual stream, updated in place
        self._c.run(x1.data_ptr(), pos, k, v, cos_p + ro, sin_p + ro, cache.max_seq, kv16)
        if self.attn_only:
            x1 += self.scaled(self.ffn(self.ffn_norm(x1.view(1, -1)))).reshape(-1)
        return x1.view(1, 1, -1)

    def rows(self, x: Tensor, layer: int, rows, cache: KVCache, rope) -> Tensor:
        """One token of each of B sequences (``Rows``; x (B, 1, D)) in one C call
        (``DecodeBlock.rows``: the weights read once, each row's numbers those of a lone
        sequence); needs ``takes_rows``. The cache is the batch's (slots in dimension 1)."""
        cos_p, sin_p, n_rope = self._rope_addresses(rope)
        check_rope_room(rows.max_position, n_rope)
        k, v, kv16 = self._layer_cache(cache, layer)
        B = x.shape[0]
        x1 = x.reshape(B, -1).clone()  # the residual streams, updated in place
        pos32, slots32 = rows.c_positions, rows.c_slots
        self._c.run_rows(x1.data_ptr(), B, pos32.data_ptr(), slots32.data_ptr(), k, v,
                         cache.k.stride(1), cos_p, sin_p, cache.max_seq, kv16)
        if self.attn_only:
            x1 += self.scaled(self.ffn(self.ffn_norm(x1)))
        return x1.view(B, 1, -1)


class FusedStack:
    """Every block of a model whose blocks are all on the C library (``FusedDecode.takes_rows``)
    as one call per decode step (``cpu.DecodeStack``): a single sequence's token (its slot 0), or
    ``Rows``: one token of each of several sequences, or a prompt's tokens as rows of its slot
    (``Transformer._prompt_rows``). The same numbers as the blocks called one
    by one, without a Python call and a lock per block. ``Transformer.blocks`` makes it on first
    use (``stack_of``), when the blocks' C objects exist."""

    def __init__(self, model, blocks):
        from .. import cpu

        self._model = [model]  # a list: no module registration, no reference cycle in repr
        self._stack = cpu.DecodeStack(blocks)
        # a sparse FFN's rows of a step or a prompt chunk sum their neurons over the threads'
        # ranges of the rows' union: a row's last bits can depend on the other rows
        self.exact = not any(b.sparse for b in blocks)
        self._ropes_key = None
        self._one = np.zeros(2, dtype=np.int32)  # a single token: [position, slot 0]
        self._one_ptr = self._one.__array_interface__["data"][0]

    def __repr__(self) -> str:
        return f"FusedStack({self._stack.n} blocks in one C call per decode step)"

    def _ropes(self):
        model = self._model[0]
        key = (model.rope[0], None if model.rope_local is None else model.rope_local[0],
               None if model.rope_none is None else model.rope_none[0])
        if self._ropes_key is None or any(a is not b for a, b in zip(key, self._ropes_key)):
            tables = [model.rope_of(i) for i in range(model.cfg.n_layers)]
            self._ropes_arrays = self._stack.rope_tables(tables)
            self._ropes_key = key
        return self._ropes_arrays

    def __call__(self, x: Tensor, pos, cache: KVCache) -> Tensor:
        ropes = self._ropes()
        k_ptr, v_ptr, kv16 = FusedDecode._layer_cache(cache, 0)
        if isinstance(pos, Rows):
            B, last = x.shape[0], pos.max_position
            pos_ptr, slots_ptr = pos.c_positions.data_ptr(), pos.c_slots.data_ptr()
        else:  # one token of the cache's sequence 0
            B, last = 1, int(pos)
            self._one[0] = last
            pos_ptr, slots_ptr = self._one_ptr, self._one_ptr + 4
        check_rope_room(last, ropes[3])
        x1 = x.reshape(B, -1).clone()  # the residual streams, updated in place
        self._stack.run(x1.data_ptr(), B, pos_ptr, slots_ptr, k_ptr, v_ptr, cache.k.stride(0),
                        cache.k.stride(1), ropes, cache.max_seq, kv16)
        return x1.view(B, 1, -1)


def stack_of(model) -> FusedStack | None:
    """``FusedStack`` of ``model`` when every block is on the C library, else None."""
    blocks = []
    for i, block in enumerate(model.layers):
        if block.fused is None or not block.fused.takes_rows(i) or block.fused.attn_only:
            return None
        blocks.append(block.fused._c)
    return FusedStack(model, blocks)


def _c_block(block: Block, layer: int):
    """``sparseinfer.cpu.DecodeBlock`` for ``block`` when its weights are on the C kernels (the
    file's blocks in ``GGMLLinear``, or fp32 ``FloatLinear``) and its FFN is the dense one on them
    or a sparse FFN the C block takes (``SparseFFN.c_block_ffn``); else None (the numba kernels
    around the block's own modules)."""
    from ..models.model import FFN, MoE
    from ..quant.linear import FloatLinear, GGMLLinear
    from ..sparse.ffn import SparseFFN

    attn, ffn = block.attn, block.ffn
    lins = {"qkv": attn.wqkv, "wo": attn.wo}
    sparse = ffn.c_block_ffn() if type(ffn) is SparseFFN else None
    # a mixture of experts: the block's attention in C, its experts after it (fused/experts.py)
    attn_only = type(ffn) is MoE
    if type(ffn) is FFN:
        lins.update(w_in=ffn.w_in, down=ffn.down)
    if len(lins) < (2 if sparse or attn_only else 4) or not all(
            type(m) in (GGMLLinear, FloatLinear) and m.mats for m in lins.values()):
        return None
    from .. import cpu
    from ..config import FFN_KINDS

    cfg = attn.cfg
    kind = FFN_KINDS[ffn.kind_name if sparse else cfg.ffn_kind]
    if len(lins["qkv"].mats) > 4 or ("w_in" in lins and len(lins["w_in"].mats) > 4):
        return None
    if cfg.parallel or cfg.post_norm or block.ffn_norm is None:
        return None
    if attn_only and not isinstance(block.ffn_post_norm, torch.nn.Identity):
        return None  # (the C block's attention-only mode has no FFN post-norm)

    def weight(norm):  # a Norm, or nn.Identity where the architecture has none
        return getattr(norm, "weight", None) if norm is not None else None

    return cpu.DecodeBlock(
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, d_ff=0 if attn_only else cfg.d_ff, gated=kind.gated,
        gate_act=kind.gate_act,
        up_act=kind.up_act, interleaved=bool(cfg.rope_interleaved), eps=float(block.attn_norm.eps),
        attn_norm=block.attn_norm.weight, ffn_norm=block.ffn_norm.weight,
        **{"w_in": [], "down": [], **{name: m.mats for name, m in lins.items()}},
        biases={"down": ffn.down_bias if sparse else None,
                **{name: m.bias for name, m in lins.items()}},
        sparse=sparse,
        q_norm=weight(attn.q_norm), k_norm=weight(attn.k_norm),
        attn_post_norm=weight(block.attn_post_norm), ffn_post_norm=weight(block.ffn_post_norm),
        window=int(cfg.window(layer) or 0), scale=cfg.attn_scale or None,
        softcap=float(cfg.attn_softcap or 0.0), residual=float(cfg.residual_scale))


def supports(model) -> bool:
    """Whether the fused kernels can run ``model``'s attention (CPU fp32, RMSNorm, RoPE)."""
    cfg = model.cfg
    return (model.device.type == "cpu" and model.dtype == torch.float32 and cfg.norm == "rms"
            and cfg.pos == "rope")


def attend_rows(cfg, layer: int, qkv: Tensor, rows, cache: KVCache, rope) -> Tensor:
    """``Rows.kernel``: ``Attention.attend_rows`` of a plain layer with the fused kernel: rope,
    cache write and attention of each row (no torch ops, so a row's numbers do not depend on the
    batch): numba's row after row for a float32 cache, the C library's for a float16 one (every
    row in one call, ``cpu.attend_rows_raw``, each row as its own ``cpu.attend_token``). Needs
    ``supports(model)``; the cache is the batch's (slots in dimension 1)."""
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = qkv.float().contiguous()
    out = torch.empty(qkv.shape[0], nh * hd)
    if cache.k.dtype == torch.float16:
        from .. import cpu

        cos_p, sin_p, n_rope = rope_pointers(rope, hd)
        check_rope_room(rows.max_position, n_rope)
        k_p, v_p, _ = FusedDecode._layer_cache(cache, layer)
        if not (cache.k[layer, 0].is_contiguous() and cache.v[layer, 0].is_contiguous()):
            raise ValueError("the KV cache: expected each slot's keys and values contiguous")
        cpu.attend_rows_raw(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], k_p, v_p,
                            cache.k.stride(1) * 2, True, rows.c_positions.data_ptr(),
                            rows.c_slots.data_ptr(),
                            cos_p, sin_p, nh, nkv, hd, cache.max_seq,
                            bool(cfg.rope_interleaved), 1.0 / math.sqrt(hd), out.data_ptr())
        return out
    q_rows = qkv.numpy()
    out_np = out.numpy()
    cos, sin = rope[0].numpy(), rope[1].numpy()
    kc, vc = cache.k[layer].numpy(), cache.v[layer].numpy()  # (slots, nkv, max_seq, hd)
    scores = np.empty(cache.max_seq, dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(hd))
    for i, (pos, slot) in enumerate(zip(rows.positions.tolist(), rows.slots.tolist())):
        _attend(q_rows[i], kc[slot], vc[slot], pos, cos[pos], sin[pos], nh, nkv, scale, scores,
                out_np[i], cfg.rope_interleaved)
    return out
