"""Checkpoint tensor names as data: one table per format and architecture, file name <-> our
canonical name (``layers.{i}.attn.wq`` ...; ``.weight`` / ``.bias`` carried over).

The GGUF tables are built on gguf-py's own constants (``gguf.TENSOR_NAMES``), so loading,
quantization and export all speak llama.cpp's names through this one module.
"""

from __future__ import annotations

import re

from gguf import MODEL_TENSOR as T
from gguf import TENSOR_NAMES


def _gguf(name: T) -> str:
    return TENSOR_NAMES[name].replace("{bid}", "{i}")


# tensors every GGUF transformer of ours shares: (gguf-py constant, canonical prefix)
_GGUF_COMMON = (
    (T.TOKEN_EMBD, "tok_emb"),
    (T.OUTPUT_NORM, "norm"),
    (T.OUTPUT, "lm_head"),
    (T.ATTN_NORM, "layers.{i}.attn_norm"),
    (T.ATTN_Q, "layers.{i}.attn.wq"),
    (T.ATTN_K, "layers.{i}.attn.wk"),
    (T.ATTN_V, "layers.{i}.attn.wv"),
    (T.ATTN_OUT, "layers.{i}.attn.wo"),
    (T.FFN_NORM, "layers.{i}.ffn_norm"),
    (T.FFN_UP, "layers.{i}.ffn.up"),
    (T.FFN_DOWN, "layers.{i}.ffn.down"),
)
# sparse GGUFs (ours and PowerInfer's) store the down projection transposed: [d_ff, d_model]
_DOWN_T = ("blk.{i}.ffn_down_t", "layers.{i}.ffn.down_t")

# mixture of experts (Mixtral is written as "llama", Qwen3-MoE as "qwen3moe"): the router, and
# each projection of every expert as one 3-D tensor [experts, rows, cols], which the loader reads
# as one matrix per expert (``layers.{i}.ffn.experts.{e}.gate`` ...: ``EXPERT_STACKS``)
_GGUF_MOE = {_gguf(T.FFN_GATE_INP): "layers.{i}.ffn.router",
             _gguf(T.FFN_GATE_EXP): "layers.{i}.ffn.gate_exps",
             _gguf(T.FFN_UP_EXP): "layers.{i}.ffn.up_exps",
             _gguf(T.FFN_DOWN_EXP): "layers.{i}.ffn.down_exps"}
# a stacked experts tensor's canonical leaf -> each expert's own
EXPERT_STACKS = {"ffn.gate_exps": "ffn.experts.{e}.gate", "ffn.up_exps": "ffn.experts.{e}.up",
                 "ffn.down_exps": "ffn.experts.{e}.down"}

GGUF_LLAMA_NAMES = {**{_gguf(t): c for t, c in _GGUF_COMMON},
                    _gguf(T.FFN_GATE): "layers.{i}.ffn.gate", _DOWN_T[0]: _DOWN_T[1],
                    **_GGUF_MOE}
# per-head q/k RMSNorm (Qwen3, Gemma 3)
_GGUF_QK_NORM = {_gguf(T.ATTN_Q_NORM): "layers.{i}.attn.q_norm",
                 _gguf(T.ATTN_K_NORM): "layers.{i}.attn.k_norm"}
GGUF_QWEN3_NAMES = {**GGUF_LLAMA_NAMES, **_GGUF_QK_NORM}  # (and Qwen3-MoE's experts)
# Phi-3: q/k/v in one tensor, gate and up in one (gate rows first, as our fused w_in)
GGUF_PHI3_NAMES = {**{_gguf(t): c for t, c in _GGUF_COMMON if t not in
                      (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.FFN_UP)},
                   _gguf(T.ATTN_QKV): "layers.{i}.attn.wqkv", _gguf(T.FFN_UP): "layers.{i}.ffn.w_in",
                   _DOWN_T[0]: _DOWN_T[1]}
# Falcon: fused q/k/v, an optional second input norm for the FFN (Falcon-40B), ungated GELU MLP
GGUF_FALCON_NAMES = {**{_gguf(t): c for t, c in _GGUF_COMMON if t not in
                        (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.FFN_NORM)},
                     _gguf(T.ATTN_QKV): "layers.{i}.attn.wqkv",
                     _gguf(T.ATTN_NORM_2): "layers.{i}.ffn_norm", _DOWN_T[0]: _DOWN_T[1]}
# Gemma 2/3: norms on the attention and FFN outputs too
GGUF_GEMMA_NAMES = {**GGUF_LLAMA_NAMES, **_GGUF_QK_NORM,
                    _gguf(T.ATTN_POST_NORM): "layers.{i}.attn_post_norm",
                    _gguf(T.FFN_POST_NORM): "layers.{i}.ffn_post_norm"}
# sparseinfer's own GGUF layout for OPT-style models (llama.cpp has none): learned positions
GGUF_OPT_NAMES = {**{_gguf(t): c for t, c in _GGUF_COMMON},
                  _gguf(T.POS_EMBD): "pos_emb", _DOWN_T[0]: _DOWN_T[1]}

HF_LLAMA_NAMES = {
    "model.embed_tokens": "tok_emb",
    "model.norm": "norm",
    "lm_head": "lm_head",
    "model.layers.{i}.input_layernorm": "layers.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj": "layers.{i}.attn.wq",
    "model.layers.{i}.self_attn.k_proj": "layers.{i}.attn.wk",
    "model.layers.{i}.self_attn.v_proj": "layers.{i}.attn.wv",
    "model.layers.{i}.self_attn.o_proj": "layers.{i}.attn.wo",
    "model.layers.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "model.layers.{i}.mlp.gate_proj": "layers.{i}.ffn.gate",
    "model.layers.{i}.mlp.up_proj": "layers.{i}.ffn.up",
    "model.layers.{i}.mlp.down_proj": "layers.{i}.ffn.down",
}

HF_QWEN3_NAMES = {**HF_LLAMA_NAMES,
                  "model.layers.{i}.self_attn.q_norm": "layers.{i}.attn.q_norm",
                  "model.layers.{i}.self_attn.k_norm": "layers.{i}.attn.k_norm"}

# mixtures of experts: the router, then each expert's gated MLP under its own index
HF_MIXTRAL_NAMES = {**{k: v for k, v in HF_LLAMA_NAMES.items() if ".mlp." not in k},
                    "model.layers.{i}.block_sparse_moe.gate": "layers.{i}.ffn.router",
                    "model.layers.{i}.block_sparse_moe.experts.{e}.w1":
                        "layers.{i}.ffn.experts.{e}.gate",
                    "model.layers.{i}.block_sparse_moe.experts.{e}.w3":
                        "layers.{i}.ffn.experts.{e}.up",
                    "model.layers.{i}.block_sparse_moe.experts.{e}.w2":
                        "layers.{i}.ffn.experts.{e}.down"}
HF_QWEN3MOE_NAMES = {**{k: v for k, v in HF_QWEN3_NAMES.items() if ".mlp." not in k},
                     "model.layers.{i}.mlp.gate": "layers.{i}.ffn.router",
                     **{f"model.layers.{{i}}.mlp.experts.{{e}}.{n}_proj":
                        f"layers.{{i}}.ffn.experts.{{e}}.{n}" for n in ("gate", "up", "down")}}

HF_PHI3_NAMES = {**{k: v for k, v in HF_LLAMA_NAMES.items() if not k.endswith(
                      ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))},
                 "model.layers.{i}.self_attn.qkv_proj": "layers.{i}.attn.wqkv",
                 "model.layers.{i}.mlp.gate_up_proj": "layers.{i}.ffn.w_in"}

# Falcon: query_key_value rows grouped per kv head ([q..., k, v] per group: ModelSource.qkv_grouped)
HF_FALCON_NAMES = {
    "transformer.word_embeddings": "tok_emb",
    "transformer.ln_f": "norm",
    "lm_head": "lm_head",
    "transformer.h.{i}.input_layernorm": "layers.{i}.attn_norm",
    "transformer.h.{i}.ln_attn": "layers.{i}.attn_norm",
    "transformer.h.{i}.ln_mlp": "layers.{i}.ffn_norm",
    "transformer.h.{i}.post_attention_layernorm": "layers.{i}.ffn_norm",
    "transformer.h.{i}.self_attention.query_key_value": "layers.{i}.attn.wqkv",
    "transformer.h.{i}.self_attention.dense": "layers.{i}.attn.wo",
    "transformer.h.{i}.mlp.dense_h_to_4h": "layers.{i}.ffn.up",
    "transformer.h.{i}.mlp.dense_4h_to_h": "layers.{i}.ffn.down",
}

# Gemma 2/3: post_attention_layernorm is the attention *output* norm; the FFN has its own pre-norm
HF_GEMMA_NAMES = {**HF_QWEN3_NAMES,
                  "model.layers.{i}.post_attention_layernorm": "layers.{i}.attn_post_norm",
                  "model.layers.{i}.pre_feedforward_layernorm": "layers.{i}.ffn_norm",
                  "model.layers.{i}.post_feedforward_layernorm": "layers.{i}.ffn_post_norm"}

HF_OPT_NAMES = {
    "model.decoder.embed_tokens": "tok_emb",
    "model.decoder.embed_positions": "pos_emb",
    "model.decoder.final_layer_norm": "norm",
    "model.decoder.project_in": "project_in",
    "model.decoder.project_out": "project_out",
    "lm_head": "lm_head",
    "model.decoder.layers.{i}.self_attn_layer_norm": "layers.{i}.attn_norm",
    "model.decoder.layers.{i}.self_attn.q_proj": "layers.{i}.attn.wq",
    "model.decoder.layers.{i}.self_attn.k_proj": "layers.{i}.attn.wk",
    "model.decoder.layers.{i}.self_attn.v_proj": "layers.{i}.attn.wv",
    "model.decoder.layers.{i}.self_attn.out_proj": "layers.{i}.attn.wo",
    "model.decoder.layers.{i}.final_layer_norm": "layers.{i}.ffn_norm",
    "model.decoder.layers.{i}.fc1": "layers.{i}.ffn.up",
    "model.decoder.layers.{i}.fc2": "layers.{i}.ffn.down",
}

# HF config "hidden_act" -> our FFN kind for gated (llama-style) MLPs
GATED_ACT_TO_KIND = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
                     "gelu_pytorch_tanh": "geglu_tanh", "gelu_tanh": "geglu_tanh",
                     "relu": "reglu", "drelu": "drelu"}
UNGATED_ACT_TO_KIND = {"relu": "relu", "gelu": "gelu"}

HF_ARCHS = {  # config.json "architectures"[0] -> (family, name map)
    "LlamaForCausalLM": ("llama", HF_LLAMA_NAMES),
    "MistralForCausalLM": ("mistral", HF_LLAMA_NAMES),
    "Qwen2ForCausalLM": ("qwen2", HF_LLAMA_NAMES),
    "Qwen3ForCausalLM": ("qwen3", HF_QWEN3_NAMES),
    "MixtralForCausalLM": ("mixtral", HF_MIXTRAL_NAMES),
    "Qwen3MoeForCausalLM": ("qwen3moe", HF_QWEN3MOE_NAMES),
    "Phi3ForCausalLM": ("phi3", HF_PHI3_NAMES),
    "SmolLM3ForCausalLM": ("smollm3", HF_LLAMA_NAMES),
    "GraniteForCausalLM": ("granite", HF_LLAMA_NAMES),
    "FalconForCausalLM": ("falcon", HF_FALCON_NAMES),
    "Gemma2ForCausalLM": ("gemma2", HF_GEMMA_NAMES),
    "Gemma3ForCausalLM": ("gemma3", HF_GEMMA_NAMES),
    "OPTForCausalLM": ("opt", HF_OPT_NAMES),
}
# general.architecture -> name map (llama.cpp writes Mistral as "llama")
GGUF_ARCHS = {"llama": GGUF_LLAMA_NAMES, "qwen2": GGUF_LLAMA_NAMES, "qwen3": GGUF_QWEN3_NAMES,
              "qwen3moe": GGUF_QWEN3_NAMES,
              "phi3": GGUF_PHI3_NAMES, "falcon": GGUF_FALCON_NAMES, "gemma2": GGUF_GEMMA_NAMES, "gemma3": GGUF_GEMMA_NAMES, "opt": GGUF_OPT_NAMES,
              "bamboo": GGUF_LLAMA_NAMES,  # bamboo: PowerInfer's dReLU llama variant
              "smollm3": GGUF_LLAMA_NAMES, "granite": GGUF_LLAMA_NAMES,
              "granitemoe": GGUF_LLAMA_NAMES}

# family -> the ModelConfig fields it fixes, whatever the file says (the rest is read from the
# file's hyper-parameters). ``rope_interleaved`` applies to GGUF files only: llama.cpp permutes
# the Q/K rows of "llama" for rope over adjacent pairs (LLAMA_ROPE_TYPE_NORM) and leaves NEOX-rope
# architectures (Qwen) in rotate-half order.
ARCH_FIELDS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "qwen3moe": {"qk_norm": True},
    "mixtral": {},
    "phi3": {},
    "falcon": {"norm": "layer"},
    "gemma2": {"scale_embeddings": True, "post_norms": True},
    "gemma3": {"scale_embeddings": True, "post_norms": True, "qk_norm": True},
    "opt": {},
    "bamboo": {},
    "smollm3": {},
    "granite": {},
    "granitemoe": {},
}
GGUF_FFN_KIND = {"gemma2": "geglu_tanh", "gemma3": "geglu_tanh", "falcon": "gelu",
                 "bamboo": "drelu", "opt": "relu"}  # default: swiglu
# ... and in files with predictors (PowerInfer's models are ReLU-family: ReluLLaMA/ProSparse
# are ReGLU, Bamboo dReLU, OPT and ReluFalcon a ReLU MLP)
GGUF_SPARSE_FFN_KINDS = {"llama": "reglu", "bamboo": "drelu", "opt": "relu", "falcon": "relu"}
GGUF_ROPE_INTERLEAVED = {"llama": True, "bamboo": True, "opt": True, "smollm3": True,
                         "granite": True, "granitemoe": True,
                         "qwen2": False, "qwen3": False,
                         "qwen3moe": False, "phi3": False,
                         "falcon": False,
                         "gemma2": False, "gemma3": False}
# fields GGUF files of an architecture imply (llama.cpp's Falcon graph is always parallel)
GGUF_ARCH_FIELDS: dict[str, dict] = {"falcon": {"parallel": True}}
# GGUF architectures whose attn_norm feeds the FFN when attn_norm_2 exists (gguf-py maps
# Falcon-40B's ln_mlp to attn_norm and ln_attn to attn_norm_2): canonical names swapped on load
GGUF_SWAPPED_NORMS = {"falcon"}
# Hugging Face checkpoints whose fused query_key_value rows are grouped per kv head
HF_QKV_GROUPED = {"falcon"}
# Hugging Face Gemma norms compute x * (1 + w); llama.cpp's converter stores 1 + w, as we hold it
HF_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
# GGUF files keep no per-layer window list: llama.cpp fixes these per architecture. Every n-th
# layer attends globally, the others over ``attention.sliding_window``; Gemma 3's windowed
# layers use their own rope base.
GGUF_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GGUF_ROPE_THETA_LOCAL = {"gemma3": 10000.0}
# every n-th layer without rope (llama.cpp's n_no_rope_layer_step; the file says nothing)
GGUF_NOPE_EVERY = {"smollm3": 4}

Compiled = list[tuple[re.Pattern, str]]


def compile_names(names: dict[str, str]) -> Compiled:
    out = []
    for src, dst in names.items():
        pat = (re.escape(src).replace(re.escape("{i}"), r"(?P<i>\d+)")
               .replace(re.escape("{e}"), r"(?P<e>\d+)"))
        out.append((re.compile(pat + r"\.(?P<suffix>weight|bias)$"), dst))
    return out


def map_name(name: str, compiled: Compiled) -> str | None:
    """The canonical name of checkpoint tensor ``name`` (None: not a model tensor)."""
    for pat, dst in compiled:
        m = pat.match(name)
        if m:
            d = m.groupdict()
            return (dst.replace("{i}", d.get("i") or "").replace("{e}", d.get("e") or "")
                    + "." + d["suffix"])
    return None


def source_name(canon: str, names: dict[str, str]) -> str | None:
    """The checkpoint's name for a canonical tensor name under the map ``names`` (None: none)."""
    m = re.match(r"^(?:layers\.(\d+)\.)?(.*)\.(weight|bias)$", canon)
    if m:
        i, rest, suffix = m.groups()
        e = re.search(r"experts\.(\d+)\.", rest)
        if e:
            rest = rest.replace(e.group(0), "experts.{e}.")
        for src, dst in names.items():
            if dst == (f"layers.{{i}}.{rest}" if i is not None else rest):
                return (src.replace("{i}", i or "").replace("{e}", e.group(1) if e else "")
                        + "." + suffix)
        for stack, each in EXPERT_STACKS.items():  # GGUF: one tensor of every expert's
            if e and rest == each:
                return source_name(f"layers.{i}.{stack}.{suffix}", names)
    return None
