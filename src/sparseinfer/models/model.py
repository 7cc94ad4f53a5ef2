"""One readable decoder-only transformer covering the llama family (SwiGLU / GeGLU / ReGLU / dReLU,
RMSNorm, RoPE, GQA; Llama 3.1 rope factors, Mistral windows), Qwen2/3 (q/k/v biases, q/k norms),
Gemma 2/3 (GeGLU-tanh, scaled embeddings, post-norms, per-layer windows and rope bases,
soft-capping), Phi-3, Falcon (parallel blocks) and OPT-style models (LayerNorm, learned positions,
biased ReLU MLP; OPT-350m's post-norm blocks and projected embeddings).

Everything that differs between architectures is a field of ``ModelConfig``; this file has no
loading, sampling or CLI in it. Which module holds each weight (fp32, bf16, 4-bit or int8
projections, a sparse FFN, a mapped embedding) is decided before the model is built
(``models/plan.py``) and handed in as ``modules``: the model is built once, on the meta device,
and filled from the file (``models/build.py``); ``print(model)`` shows what runs. q/k/v and
gate/up are fused for fewer calls per token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import FFN_KINDS, ModelConfig
from ..fileio import lazy_zeros
from ..quant.linear import FloatLinear

ACTIVATIONS = {
    None: lambda t: t,
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


class KVCache:
    """Preallocated keys/values for every layer: (L, B, n_kv_heads, max_seq, head_dim), in
    ``dtype`` (the model's ``kv_dtype``: float16 by default where the C blocks read it; readers
    cast to the activations' type). On the CPU their pages are mapped as positions are first
    written (``fileio.lazy_zeros``): a long context costs what it uses."""

    def __init__(self, cfg: ModelConfig, batch: int, max_seq: int, dtype: torch.dtype, device=None):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        if torch.device(device if device is not None else torch.get_default_device()).type == "cpu":
            self.k, self.v = lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq = max_seq
        # numpy views for the fused CPU kernels, owned by this cache (never keyed on an id)
        cpu32 = self.k.device.type == "cpu" and dtype == torch.float32
        self.k_np = self.k.numpy() if cpu32 else None
        self.v_np = self.v.numpy() if cpu32 else None

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last ``dim`` (default d_model) features; filled by name
    (``<module path>.weight``) in ``models/build.py``."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        dim = dim or cfg.d_model
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(dim), requires_grad=False)
            if cfg.norm == "layer"
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_angles(cfg: ModelConfig, positions: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos/sin of shape (len(positions), head_dim) for the rotate-half (Hugging Face) layout;
    ``local``: the windowed layers' own base (Gemma 3), without the global layers' scaling.
    Positions may be negative (a rotation back, as the context shift uses)."""
    half = cfg.head_dim // 2
    theta = cfg.rope_theta_local if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    if cfg.rope_factors and not local:  # Llama 3.1 / linear scaling
        inv_freq = inv_freq / torch.tensor(cfg.rope_factors, dtype=torch.float64)
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rope_tables(cfg: ModelConfig, max_seq: int, local: bool = False) -> tuple[Tensor, Tensor]:
    """``rope_angles`` of positions 0 .. max_seq - 1."""
    return rope_angles(cfg, torch.arange(max_seq), local)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd), the first half of each row holding the pair angles
    half = x.shape[-1] // 2
    if interleaved:  # pairs (2i, 2i+1) rotated by angle i
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., :half], sin[..., :half]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """``cap · tanh(x / cap)`` (Gemma 2/3's soft-capping of scores and logits); ``x`` if no cap."""
    return torch.tanh(x / cap) * cap if cap else x


PROMPT_ROWS = 64  # a prompt's tokens per C call on a fused-stack model (Transformer._prompt_rows)


@dataclass(frozen=True)
class Rows:
    """Several sequences in one decode step (continuous batching, ``models/batch.py``): row i of
    the input (B, 1, D) is the sequence in cache slot ``slots[i]`` at ``positions[i]``, and
    attends to that slot's keys 0..positions[i]; rows of one slot at consecutive positions are
    a prompt's tokens (every row's key and value are written before any row attends). Passed to ``Block`` / ``Attention`` in place of
    the single-sequence ``pos``. ``kernel``: a per-row attention kernel for the layers where
    ``Attention.plain`` holds (``fused.decode.attend_rows``), or None: ``Attention.attend_rows``
    (torch) everywhere."""

    positions: Tensor  # (B,) int64
    slots: Tensor  # (B,) int64
    kernel: Callable[..., Tensor] | None = None
    # the same as int32 and the largest position, for the C block (fused/decode.py); derived
    c_positions: Tensor = field(init=False, repr=False, compare=False)
    c_slots: Tensor = field(init=False, repr=False, compare=False)
    max_position: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.positions.shape != self.slots.shape or self.positions.dim() != 1:
            raise ValueError(f"Rows: expected positions and slots of one shape (B,), got "
                             f"{list(self.positions.shape)} and {list(self.slots.shape)}")
        object.__setattr__(self, "c_positions", self.positions.to("cpu", torch.int32).contiguous())
        object.__setattr__(self, "c_slots", self.slots.to("cpu", torch.int32).contiguous())
        object.__setattr__(self, "max_position", int(self.positions.max()))


class DenseModules:
    """The default ``modules``: float projections and embeddings, dense FFNs, no fused decode.
    ``models/build.py`` passes one that follows a load plan."""

    fused = False

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype

    def linear(self, path: str, n_in: int, n_out: int, bias: bool) -> nn.Module:
        return FloatLinear(n_in, n_out, bias, self.dtype)

    def embedding(self, path: str, n: int, d: int) -> nn.Module:
        return nn.Embedding(n, d, dtype=self.dtype)

    def ffn(self, layer: int, cfg: ModelConfig) -> nn.Module | None:
        return None  # the dense FFN below


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, modules, prefix: str):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.wqkv = modules.linear(prefix + "wqkv", cfg.d_model, (nh + 2 * nkv) * hd,
                                   cfg.attn_bias or cfg.qkv_bias)
        self.wo = modules.linear(prefix + "wo", nh * hd, cfg.d_model, cfg.attn_bias)
        # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
        self.q_norm = Norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = Norm(cfg, hd) if cfg.qk_norm else None
        self.scale = cfg.attn_scale or 1.0 / math.sqrt(hd)
        self.softcap = cfg.attn_softcap

    def mask(self, layer: int, pos: int, T: int, S: int, device) -> Tensor | None:
        """(T, S) True where query pos+t may see key s: causal, and within the layer's window."""
        window = self.cfg.window(layer)
        if T == 1 and not (window and S > window):
            return None  # one new token sees the whole cache
        return self.allowed(layer, torch.arange(pos, pos + T, device=device), S)

    def allowed(self, layer: int, positions: Tensor, S: int) -> Tensor:
        """(N, S) True where a query at ``positions[n]`` may see key s: causal, and within the
        layer's window."""
        q = positions.view(-1, 1)
        k = torch.arange(S, device=positions.device).view(1, S)
        allowed = k <= q
        window = self.cfg.window(layer)
        if window:
            allowed &= q - k < window
        return allowed

    def plain(self, layer: int) -> bool:
        """Whether this layer's attention is softmax(q k / sqrt(hd)) v over rope'd q and k and
        nothing else (what ``Rows.kernel`` implements)."""
        return not (self.q_norm is not None or self.softcap or self.cfg.attn_scale
                    or self.cfg.window(layer))

    def forward(self, x: Tensor, layer: int, pos: int | Rows, cache: KVCache, rope) -> Tensor:
        if isinstance(pos, Rows):
            return self.forward_rows(x, layer, pos, cache, rope)
        cfg = self.cfg
        B, T, _ = x.shape
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        q, k, v = self.wqkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope[0][pos : pos + T], rope[1][pos : pos + T]
            il = cfg.rope_interleaved
            q, k = apply_rope(q, cos, sin, il), apply_rope(k, cos, sin, il)
        cache.k[layer, :B, :, pos : pos + T] = k
        cache.v[layer, :B, :, pos : pos + T] = v
        S = pos + T
        keys, values = cache.k[layer, :B, :, :S], cache.v[layer, :B, :, :S]  # (B, nkv, S, hd)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # (a float16 cache: float32 copies)
        allowed = self.mask(layer, pos, T, S, x.device)
        if not self.softcap:  # torch's fused attention: no (T, S) scores in memory
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                                 scale=self.scale, enable_gqa=nh != nkv)
            return self.wo(out.transpose(1, 2).reshape(B, T, nh * hd))
        # soft-capped scores: grouped-query attention as batched matmuls,
        # (B, nkv, group*T, hd) x (B, nkv, hd, S)
        group = nh // nkv
        qg = q.reshape(B, nkv, group * T, hd)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # (B, nkv, group*T, S)
        scores = soft_cap(scores, self.softcap)
        if allowed is not None:
            scores = scores.view(B, nkv, group, T, S).masked_fill(~allowed, float("-inf"))
            scores = scores.view(B, nkv, group * T, S)
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # (B, nkv, group*T, hd)
        out = out.view(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)
        return self.wo(out)

    def forward_rows(self, x: Tensor, layer: int, rows: Rows, cache: KVCache, rope) -> Tensor:
        """One token per row (B, 1, D), each its own sequence (``Rows``): the projections run
        over all rows at once, the attention per row."""
        B = x.shape[0]
        qkv = self.wqkv(x).view(B, -1)  # (B, (nh + 2 nkv) hd)
        if (rows.kernel is not None and self.plain(layer)
                and cache.k.dtype in (torch.float32, torch.float16)):
            out = rows.kernel(self.cfg, layer, qkv, rows, cache, rope)
        else:
            out = self.attend_rows(qkv, layer, rows, cache, rope)
        return self.wo(out.view(B, 1, -1))

    def attend_rows(self, qkv: Tensor, layer: int, rows: Rows, cache: KVCache, rope) -> Tensor:
        """q/k norms, rope, the cache write and attention of each row of ``qkv`` at its own
        position in its own slot, as ``forward`` does for one sequence. Returns (B, nh hd).
        The torch reference of ``Rows.kernel``."""
        cfg = self.cfg
        B = qkv.shape[0]
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        positions, slots = rows.positions, rows.slots
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.reshape(B, nh, hd), k.reshape(B, nkv, hd), v.reshape(B, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)
            il = cfg.rope_interleaved
            q, k = apply_rope(q, cos, sin, il), apply_rope(k, cos, sin, il)
        cache.k[layer, slots, :, positions] = k.to(cache.k.dtype)  # (B, nkv, hd) into the slots
        cache.v[layer, slots, :, positions] = v.to(cache.v.dtype)
        where = slots.tolist()
        if len(set(where)) == B:  # one row per sequence (a decode step)
            return self._attend_slots(q, layer, positions, slots, where, cache)
        # a prompt chunk rides along: rows alone in their slot as above, each shared slot's
        # rows against that slot's keys once (not a copy of them per row)
        out = q.new_empty(B, nh * hd)
        count = Counter(where)
        lone = [i for i, s in enumerate(where) if count[s] == 1]
        if lone:
            i = torch.tensor(lone, device=q.device)
            out[i] = self._attend_slots(q[i], layer, positions[i], slots[i],
                                        [where[j] for j in lone], cache)
        for slot in (s for s in dict.fromkeys(where) if count[s] > 1):
            i = torch.tensor([j for j, s in enumerate(where) if s == slot], device=q.device)
            out[i] = self._attend_slot(q[i], layer, positions[i], slot, cache)
        return out

    def _attend_slots(self, q: Tensor, layer: int, positions: Tensor, slots: Tensor,
                      where: list[int], cache: KVCache) -> Tensor:
        """Attention of rows (B, nh, hd) each in its own slot (``where``: the slots as ints)."""
        B = q.shape[0]
        S = int(positions.max()) + 1  # keys to look at: the longest sequence's
        first = where[0]
        if where == list(range(first, first + B)):  # consecutive slots: a view
            keys = cache.k[layer, first : first + B, :, :S]  # (B, nkv, S, hd)
            values = cache.v[layer, first : first + B, :, :S]
        else:  # gather only the first S positions of each slot
            keys = cache.k[layer, :, :, :S].index_select(0, slots)
            values = cache.v[layer, :, :, :S].index_select(0, slots)
        return self._weigh(q, keys.to(q.dtype), values.to(q.dtype),
                           self.allowed(layer, positions.to(q.device), S))

    def _attend_slot(self, q: Tensor, layer: int, positions: Tensor, slot: int,
                     cache: KVCache) -> Tensor:
        """Attention of rows (n, nh, hd) of one sequence (slot ``slot``), each up to its own
        position: the slot's keys (nkv, S, hd) are read once for all of them."""
        S = int(positions.max()) + 1
        keys, values = cache.k[layer, slot, :, :S], cache.v[layer, slot, :, :S]
        return self._weigh(q, keys.to(q.dtype), values.to(q.dtype),
                           self.allowed(layer, positions.to(q.device), S))

    def _weigh(self, q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
        """softmax(q k^T * scale, soft-capped, masked by ``allowed`` (n, S)) v for rows q (n, nh,
        hd) against keys/values (n, nkv, S, hd), or (nkv, S, hd) shared by the rows."""
        cfg = self.cfg
        n, S = q.shape[0], allowed.shape[1]
        qg = q.view(n, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # (n, nkv, group, S)
        scores = soft_cap(scores, self.softcap)
        scores = scores.masked_fill(~allowed.view(n, 1, 1, S), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(n, cfg.n_heads * cfg.head_dim)


class FFN(nn.Module):
    """Dense FFN. Gated: down(act_g(gate x) * act_u(up x)); ungated: down(act_u(up x + b) ) + b."""

    def __init__(self, cfg: ModelConfig, modules, prefix: str):
        super().__init__()
        kind = FFN_KINDS[cfg.ffn_kind]
        self.gated, self.d_ff = kind.gated, cfg.d_ff
        self.act_gate, self.act_up = ACTIVATIONS[kind.gate_act], ACTIVATIONS[kind.up_act]
        n_in = 2 * cfg.d_ff if kind.gated else cfg.d_ff  # gated: rows [0, d_ff) gate, then up
        self.w_in = modules.linear(prefix + "w_in", cfg.d_model, n_in, cfg.ffn_bias)
        self.down = modules.linear(prefix + "down", cfg.d_ff, cfg.d_model, cfg.ffn_bias)

    def activations(self, x: Tensor) -> Tensor:
        """Per-neuron coefficients h (..., d_ff): the FFN output is down(h)."""
        if self.gated:
            gate, up = self.w_in(x).split(self.d_ff, dim=-1)
            return self.act_gate(gate) * self.act_up(up)
        return self.act_up(self.w_in(x))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        return self.down(self.activations(x))


class MoE(nn.Module):
    """Mixture of experts (Mixtral, Qwen3-MoE): a router scores every expert, each token runs
    the ``n_experts_used`` best-scored dense FFNs and sums their outputs weighted by the router's
    softmax (renormalized over the picked experts with ``experts_norm``)."""

    def __init__(self, cfg: ModelConfig, modules, prefix: str):
        super().__init__()
        self.k, self.renorm = cfg.n_experts_used, cfg.experts_norm
        self.router = modules.linear(prefix + "router", cfg.d_model, cfg.n_experts, False)
        self.experts = nn.ModuleList(FFN(cfg, modules, f"{prefix}experts.{e}.")
                                     for e in range(cfg.n_experts))
        # the experts' products grouped into few C calls (fused/experts.py), made on first use
        # when the experts are the C kernels' matrices; False: they are not
        self._c = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Rows x (n, d_model) -> (weights (n, k) float32, experts (n, k)), best first."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.k, dim=-1)
        if self.renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._c is None:
            from ..fused.experts import CExperts

            self._c = CExperts.of(self) or False
        if self._c:
            xf = rows.float().contiguous()
            y = self._c.one(xf[0]) if rows.shape[0] == 1 else self._c.rows(xf)
            return y.to(x.dtype).view_as(x)
        return self.loop(rows).view_as(x)

    def loop(self, rows: Tensor) -> Tensor:
        """Rows (n, d_model) through each picked expert's own modules, expert by expert: the
        reference of the grouped C calls (fused/experts.py), and the path of other weights."""
        weights, chosen = self.route(rows)
        out = torch.zeros_like(rows)
        for e in chosen.unique().tolist():  # each expert once, over the rows that picked it
            picked, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](rows[picked])
            out.index_add_(0, picked, y * weights[picked, slot, None].to(y.dtype))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, modules, layer: int):
        super().__init__()
        p = f"layers.{layer}."
        self.attn_norm, self.attn = Norm(cfg), Attention(cfg, modules, p + "attn.")
        self.ffn_norm = None if cfg.shared_norm else Norm(cfg)
        self.parallel, self.post_norm = cfg.parallel, cfg.post_norm
        self.residual = cfg.residual_scale
        self.ffn = modules.ffn(layer, cfg) or (MoE if cfg.n_experts else FFN)(cfg, modules,
                                                                             p + "ffn.")
        # norms of the attention and FFN outputs before the residual add (Gemma 2/3)
        self.attn_post_norm = Norm(cfg) if cfg.post_norms else nn.Identity()
        self.ffn_post_norm = Norm(cfg) if cfg.post_norms else nn.Identity()
        # single-token decode through the fused kernels (fused/decode.py), chosen at build time
        self.fused = None
        if modules.fused:
            from ..fused.decode import FusedDecode

            self.fused = FusedDecode(self)

    def forward(self, x: Tensor, layer: int, pos: int | Rows, cache: KVCache, rope) -> Tensor:
        """x (B, T, D) at ``pos``; or, with ``Rows``, (B, 1, D): one token of B sequences."""
        if self.fused is not None:
            if isinstance(pos, Rows):
                if self.fused.takes_rows(layer):  # one C call for every row
                    return self.fused.rows(x, layer, pos, cache, rope)
            elif x.shape[0] == 1 and x.shape[1] == 1:
                return self.fused(x, layer, pos, cache, rope)
        r = self.scaled  # each branch's output before its residual add (Granite: times r)
        if self.post_norm:  # OPT-350m: norm after each residual add
            x = self.attn_norm(x + r(self.attn(x, layer, pos, cache, rope)))
            return self.ffn_norm(x + r(self.ffn(x, x)))
        h = self.attn_norm(x)
        a = self.attn_post_norm(self.attn(h, layer, pos, cache, rope))
        if self.parallel:  # both read the block input; one residual add
            return x + r(a + self.ffn(h if self.ffn_norm is None else self.ffn_norm(x), x))
        x = x + r(a)
        # the residual goes along: predictors of PowerInfer's files read it
        return x + r(self.ffn_post_norm(self.ffn(self.ffn_norm(x), x)))

    def scaled(self, out: Tensor) -> Tensor:
        """A branch's output as its residual add takes it: times ``residual_scale``."""
        return out if self.residual == 1.0 else out * self.residual


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, modules=None, dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None):
        super().__init__()
        modules = modules or DenseModules(dtype)
        self.cfg = cfg
        E = cfg.emb_dim or cfg.d_model  # embedding width (OPT-350m: projected to d_model)
        self.tok_emb = modules.embedding("tok_emb", cfg.vocab_size, E)
        self.project_in = modules.linear("project_in", E, cfg.d_model, False) if cfg.emb_dim \
            else None
        self.project_out = modules.linear("project_out", cfg.d_model, E, False) if cfg.emb_dim \
            else None
        self.pos_emb = (
            nn.Embedding(cfg.max_seq_len + cfg.pos_offset, cfg.d_model)
            if cfg.pos == "learned"
            else None
        )
        self.layers = nn.ModuleList(Block(cfg, modules, i) for i in range(cfg.n_layers))
        self.norm = Norm(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = modules.linear("lm_head", E, cfg.vocab_size, False)
        self.rope: tuple[Tensor, Tensor] | None = None
        self.rope_local: tuple[Tensor, Tensor] | None = None  # windowed layers' own base
        self.rope_none: tuple[Tensor, Tensor] | None = None  # NoPE layers: cos 1, sin 0
        self.emb_scale = cfg.embedding_scale or (math.sqrt(cfg.d_model) if cfg.scale_embeddings
                                                 else 1.0)
        self._dtype = dtype  # activations, norms
        self.kv_dtype = kv_dtype or dtype  # the KV cache's elements (the plan's kv_dtype)
        self._stack = None  # fused.decode.FusedStack, made on first use (see blocks)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.weight.device

    def new_cache(self, batch: int = 1, max_seq: int | None = None) -> KVCache:
        max_seq = max_seq or self.cfg.max_seq_len
        if self.cfg.pos == "rope" and (self.rope is None or self.rope[0].shape[0] < max_seq):
            cos, sin = rope_tables(self.cfg, max_seq)
            self.rope = (cos.to(self.device, self.dtype), sin.to(self.device, self.dtype))
            if self.cfg.rope_theta_local:
                cos, sin = rope_tables(self.cfg, max_seq, local=True)
                self.rope_local = (cos.to(self.device, self.dtype),
                                   sin.to(self.device, self.dtype))
            if self.cfg.nope_layers:  # the identity rotation: x * 1 + rotated(x) * 0 == x
                self.rope_none = (torch.ones_like(self.rope[0]), torch.zeros_like(self.rope[1]))
        return KVCache(self.cfg, batch, max_seq, self.kv_dtype, self.device)

    @property
    def can_shift(self) -> bool:
        """Whether ``shift_cache`` can move cached keys (rope positions); a model with learned
        positions must recompute its keys and values instead."""
        return self.cfg.pos == "rope"

    def shift_cache(self, cache: KVCache, keep: int, discard: int, n_past: int) -> None:
        """Drop cache positions [keep, keep + discard) and move [keep + discard, n_past) down to
        start at ``keep``, as llama.cpp's context shift does (``seq_rm`` + ``seq_add``): values
        are copied, keys are rotated back by ``discard`` positions (rope of angle -discard, each
        layer with its own base), so they equal keys computed at their new positions up to
        rounding. Needs ``can_shift``."""
        if not self.can_shift:
            raise ValueError("shift_cache: keys of learned-position models cannot be moved")
        if not (0 <= keep and discard > 0 and keep + discard <= n_past <= cache.max_seq):
            raise ValueError(f"shift_cache: bad range keep={keep} discard={discard} "
                             f"n_past={n_past} (cache {cache.max_seq})")
        cfg = self.cfg
        back = torch.tensor([-discard])
        turns = {False: rope_angles(cfg, back)}
        if self.rope_local is not None:
            turns[True] = rope_angles(cfg, back, local=True)
        src, dst = slice(keep + discard, n_past), slice(keep, n_past - discard)
        for layer in range(cfg.n_layers):
            if layer in cfg.nope_layers:  # keys without positions: moved as they are
                cache.k[layer, :, :, dst] = cache.k[layer, :, :, src].clone()
            else:
                cos, sin = turns[self.rope_local is not None and bool(cfg.window(layer))]
                k = apply_rope(cache.k[layer, :, :, src].float(), cos, sin, cfg.rope_interleaved)
                cache.k[layer, :, :, dst] = k.to(cache.k.dtype)  # a new tensor: no overlap
            cache.v[layer, :, :, dst] = cache.v[layer, :, :, src].clone()

    def hidden(self, tokens: Tensor, pos: int, cache: KVCache) -> Tensor:
        """Final-normed hidden states (B, T, D) for ``tokens`` (B, T) placed at ``pos``."""
        T = tokens.shape[1]
        tokens = tokens.to(self.device)
        if pos + T > cache.max_seq:
            raise ValueError(f"positions {pos}..{pos + T} exceed the cache size {cache.max_seq}")
        x = self.embed(tokens, pos)
        return self.blocks(x, pos, cache)

    def embed(self, tokens: Tensor, pos: int | Rows) -> Tensor:
        """The first block's input (B, T, D) for ``tokens`` (B, T) at ``pos`` (T positions from
        there), or with ``Rows`` (B, 1): each row at its own position."""
        x = self.tok_emb(tokens)  # (B, T, D)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.emb_scale != 1.0:
            x = x * torch.tensor(self.emb_scale, dtype=x.dtype)
        if self.pos_emb is not None:
            off = self.cfg.pos_offset
            if isinstance(pos, Rows):
                x = x + self.pos_emb.weight[off + pos.positions].unsqueeze(1)
            else:
                x = x + self.pos_emb.weight[off + pos : off + pos + tokens.shape[1]]
        return x

    def blocks(self, x: Tensor, pos: int | Rows, cache: KVCache) -> Tensor:
        """Every block over ``x`` (B, T, D), then the final norm (and OPT-350m's projection).
        On a model whose blocks are all on the C library, one token per sequence (a single
        token, or ``Rows``) goes through all of them in one C call (``fused.decode.FusedStack``:
        the same numbers as the loop), and so does one sequence's prompt, its tokens as rows at
        consecutive positions (``_prompt_rows``): each token's numbers are then those it gets
        decoded alone."""
        stack = None
        if isinstance(pos, Rows) or x.shape[0] == 1:
            stack = self._fused_stack()
        if stack is not None and not isinstance(pos, Rows) and x.shape[1] > 1:
            x = self._prompt_rows(stack, x, pos, cache)
        elif stack is not None:
            x = stack(x, pos, cache)
        else:
            for i, block in enumerate(self.layers):
                x = block(x, i, pos, cache, self.rope_of(i))
        x = self.norm(x)
        return self.project_out(x) if self.project_out is not None else x

    def _prompt_rows(self, stack, x: Tensor, pos: int, cache: KVCache) -> Tensor:
        """``x`` (1, T, D), one sequence's tokens at positions pos.., through ``stack`` as rows
        of slot 0, a chunk per C call: every row's key and value are in the cache before any row
        attends, each up to its own position. A chunk's rows are bounded so that the C block's
        attention scores (rows x heads x cache positions) stay within 32 MiB."""
        T, D = x.shape[1], x.shape[2]
        per_row = self.cfg.n_heads * cache.max_seq * 4
        n = max(1, min(PROMPT_ROWS, (32 << 20) // per_row))
        out = []
        for s in range(0, T, n):
            rows = torch.arange(pos + s, pos + min(s + n, T))
            chunk = x[0, s : s + len(rows)].reshape(-1, 1, D)
            out.append(stack(chunk, Rows(rows, torch.zeros_like(rows)), cache))
        return torch.cat(out).view(1, T, D)

    def rows_exact(self) -> bool:
        """Whether a token's numbers do not depend on what else is in its batch or its prompt
        chunk (every block on the C library as one stack: GEMM rows are their GEMVs, attention
        is per row; no sparse FFN): the keys and values a sequence left in a cache then equal a
        fresh run's."""
        stack = self._fused_stack()
        return stack is not None and stack.exact

    def rope_of(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """The rope tables (cos, sin) ``layer`` uses: windowed layers of a model with a local
        base have their own, NoPE layers the identity."""
        if self.rope_none is not None and layer in self.cfg.nope_layers:
            return self.rope_none
        local = self.rope_local is not None and self.cfg.window(layer)
        return self.rope_local if local else self.rope

    def extra_repr(self) -> str:
        if self.layers[0].fused is None:
            return ""
        return ("one token per sequence: fused decode (fused/decode.py; every block in one C "
                "call when all are on the C library)")

    def _fused_stack(self):
        """The blocks' ``FusedStack``, or None; decided on first use (the blocks' C objects exist
        once the model is filled) when the plan fused the single-token decode."""
        if self._stack is None:
            if self.layers[0].fused is None:
                self._stack = False
            else:
                from ..fused.decode import stack_of

                self._stack = stack_of(self) or False
        return self._stack or None

    def finish_logits(self, logits: Tensor) -> Tensor:
        """The head's float32 output as logits: divided by ``logit_scale`` (Granite), then
        soft-capped (Gemma 2/3), where the architecture does either."""
        if self.cfg.logit_scale != 1.0:
            logits = logits / self.cfg.logit_scale
        return soft_cap(logits, self.cfg.final_softcap)

    def forward(self, tokens: Tensor, pos: int, cache: KVCache, last_only: bool = False) -> Tensor:
        """Logits (B, T, V) in float32 (or (B, 1, V) with ``last_only``)."""
        h = self.hidden(tokens, pos, cache)
        if last_only:
            h = h[:, -1:]
        return self.finish_logits(self.lm_head(h).float())
