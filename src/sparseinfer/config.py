"""Frozen configuration dataclasses shared by every part of sparseinfer.

Per-architecture differences are data here (``FFN_KINDS``, the fields of ``ModelConfig``), so the
model code has no architecture ``if`` chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FFNKind:
    """How one FFN neuron i turns the layer input x into its coefficient h_i.

    gated:    h_i = act_gate(gate_i · x) * act_up(up_i · x)      (SwiGLU, GeGLU, ReGLU, dReLU)
    ungated:  h_i = act_up(up_i · x + b_i)                       (OPT/Falcon ReLU or GELU MLP)
    The layer output is sum_i h_i * down_i. ``relu_sparse`` means h_i == 0 exactly for most
    neurons, so "active" is exact; otherwise activity is a magnitude threshold.
    """

    gated: bool
    gate_act: str | None  # "silu" | "gelu" | "gelu_tanh" | "relu" | None
    up_act: str | None  # activation applied to the up projection (None = identity)
    relu_sparse: bool


FFN_KINDS: dict[str, FFNKind] = {
    "swiglu": FFNKind(gated=True, gate_act="silu", up_act=None, relu_sparse=False),
    "geglu": FFNKind(gated=True, gate_act="gelu", up_act=None, relu_sparse=False),
    "geglu_tanh": FFNKind(gated=True, gate_act="gelu_tanh", up_act=None, relu_sparse=False),
    "reglu": FFNKind(gated=True, gate_act="relu", up_act=None, relu_sparse=True),
    "drelu": FFNKind(gated=True, gate_act="relu", up_act="relu", relu_sparse=True),
    "relu": FFNKind(gated=False, gate_act=None, up_act="relu", relu_sparse=True),
    "gelu": FFNKind(gated=False, gate_act=None, up_act="gelu", relu_sparse=False),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a decoder-only transformer."""

    arch: str  # "llama" | "opt"  (family, for messages and checkpoint maps)
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    head_dim: int = 0  # 0 = d_model // n_heads
    ffn_kind: str = "swiglu"  # key of FFN_KINDS
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    pos: str = "rope"  # "rope" | "learned"
    rope_theta: float = 10000.0
    # rope over adjacent pairs (2i, 2i+1) instead of halves (i, i + hd/2): how llama.cpp's GGUF
    # files order Q/K rows, so their weights are used as stored (no row permutation)
    rope_interleaved: bool = False
    pos_offset: int = 0  # learned positions: OPT stores 2 extra rows in front
    attn_bias: bool = False  # q/k/v/o biases
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope (Qwen3, Gemma 3)
    # rope frequency divisors, one per rotated pair (Llama 3.1 "llama3" scaling; llama.cpp's
    # rope_freqs.weight): angle_i = pos * theta^(-2i/hd) / rope_factors[i]; () = all 1
    rope_factors: tuple[float, ...] = ()
    # attention window per layer in tokens (query i sees keys j with i - j < w; 0 = the whole
    # context); () = no layer windowed (Mistral: one window for every layer)
    attn_windows: tuple[int, ...] = ()
    rope_theta_local: float = 0.0  # rope base of the windowed layers (Gemma 3); 0 = rope_theta
    # layers whose queries and keys get no rotation at all (SmolLM3: every 4th, "NoPE")
    nope_layers: tuple[int, ...] = ()
    attn_scale: float = 0.0  # q·k scale; 0 = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0 = off
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2/3); 0 = off
    scale_embeddings: bool = False  # token embeddings times sqrt(d_model) (Gemma)
    # Granite's multipliers: token embeddings times embedding_scale (0: as scale_embeddings
    # says), each attention and FFN output times residual_scale before its residual add, the
    # logits divided by logit_scale
    embedding_scale: float = 0.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    post_norms: bool = False  # a norm on the attention and FFN outputs too (Gemma 2/3)
    parallel: bool = False  # x + attn(norm(x)) + ffn(norm'(x)): one residual add (Falcon)
    shared_norm: bool = False  # parallel blocks with one input norm for both (Falcon-7B)
    post_norm: bool = False  # norm after each residual add instead of before (OPT-350m)
    final_norm: bool = True  # a norm before the LM head (OPT-350m has none)
    emb_dim: int = 0  # embedding / LM-head width with project_in/out to d_model; 0 = d_model
    ffn_bias: bool = False  # up/down biases (ungated MLPs)
    tie_embeddings: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE): every layer's FFN is ``n_experts`` FFNs of width
    # d_ff, of which a router picks ``n_experts_used`` per token, weighted by the router's
    # softmax over all experts (``experts_norm``: renormalized over the picked ones); 0 = dense
    n_experts: int = 0
    n_experts_used: int = 0
    experts_norm: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.ffn_kind not in FFN_KINDS:
            raise ValueError(f"ffn_kind: expected one of {sorted(FFN_KINDS)}, got {self.ffn_kind!r}")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm: expected 'rms' or 'layer', got {self.norm!r}")
        if self.pos not in ("rope", "learned"):
            raise ValueError(f"pos: expected 'rope' or 'learned', got {self.pos!r}")
        for name in ("rope_factors", "attn_windows", "nope_layers"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.attn_windows and len(self.attn_windows) != self.n_layers:
            raise ValueError(f"attn_windows: expected one window per layer ({self.n_layers}), "
                             f"got {len(self.attn_windows)}")
        if any(not 0 <= i < self.n_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers: expected layer numbers below {self.n_layers}, got "
                             f"{list(self.nope_layers)}")
        if self.rope_factors and len(self.rope_factors) != self.head_dim // 2:
            raise ValueError(f"rope_factors: expected head_dim/2 = {self.head_dim // 2} factors, "
                             f"got {len(self.rope_factors)}")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"n_experts_used: expected 1 to n_experts ({self.n_experts}) "
                             f"experts a token, got {self.n_experts_used}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def ffn(self) -> FFNKind:
        return FFN_KINDS[self.ffn_kind]

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window in tokens (0: the whole context)."""
        return self.attn_windows[layer] if self.attn_windows else 0

    @property
    def plain_block(self) -> bool:
        """Pre-norm attention and FFN with nothing else (no q/k norms, windows, soft-capping,
        custom scale or post-norms): what the fused decode kernels implement (the FFN a module
        they call, a mixture of experts too)."""
        return not (self.qk_norm or any(self.attn_windows) or self.attn_softcap
                    or self.attn_scale or self.post_norms or self.parallel or self.post_norm
                    or self.residual_scale != 1.0)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults follow llama.cpp's."""

    max_tokens: int = 128  # -n; -1 = until EOS or the context is full
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off (llama.cpp style, over the last repeat_last_n tokens)
    repeat_last_n: int = 64
    presence_penalty: float = 0.0  # OpenAI style
    frequency_penalty: float = 0.0  # OpenAI style
    seed: int | None = None  # None = random
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    ignore_eos: bool = False


@dataclass(frozen=True)
class SparsityConfig:
    """How the sparse runtime chooses active neurons."""

    threshold: float = 0.0  # predictor logit threshold (PowerInfer's sparse_threshold)
    mode: str = "predictor"  # "predictor" | "oracle" (exact: dense activations) | "dense"
    prefill: str = "dense"  # "dense" | "union"


@dataclass(frozen=True)
class LayerPlacement:
    """Which FFN neurons of one layer live on the fast tier (a hot-first prefix after reordering)."""

    hot: tuple[int, ...] = field(default_factory=tuple)  # neuron indices on the fast tier
    d_ff: int = 0
