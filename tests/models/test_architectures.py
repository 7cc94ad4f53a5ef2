"""Qwen2, Qwen3, Llama 3.1 (llama3 rope scaling), Mistral (sliding window), Gemma 2, Gemma 3,
SmolLM3 (layers without rope), Granite (its multipliers) and the rest of TINY_ARCHS against
transformers on tiny random models: read from the Hugging Face safetensors directory and
from a GGUF written by llama.cpp's own converter (``convert_hf_to_gguf.py``, not our exporter).
Logits within 1e-4 relative, and greedy decoding through the KV cache equal to ``generate``."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_arch_model
from sparseinfer.models.loading import load_model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _ours(lm, ids: torch.Tensor) -> torch.Tensor:
    cache = lm.model.new_cache(ids.shape[0], ids.shape[1] + 1)
    with torch.inference_mode():
        return lm.model(ids, 0, cache)


EOS = 2


def _greedy(lm, prompt: torch.Tensor, n: int) -> list[int]:
    """Prefill then one token at a time through the KV cache (the decode path)."""
    cache = lm.model.new_cache(1, prompt.shape[1] + n)
    out, pos = [], 0
    tok = prompt
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(tok, pos, cache, last_only=True)[0, -1]
            logits[EOS] = float("-inf")  # as transformers' min_new_tokens does
            nxt = int(logits.argmax())
            pos += tok.shape[1]
            out.append(nxt)
            tok = torch.tensor([[nxt]])
    return out


def _check(lm, name: str) -> None:
    ref = tiny_arch_model(name)  # same seed -> the weights that were saved
    ids = torch.randint(3, lm.config.vocab_size, (2, 37),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    got = _ours(lm, ids)
    assert got.shape == want.shape
    assert _rel_err(got, want) < 1e-4
    prompt = ids[:1, :5]
    n = 24  # past the Mistral window of 8 and the llama3 original context of 32 with the prompt
    with torch.no_grad():
        hf = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert _greedy(lm, prompt, n) == hf[0, prompt.shape[1]:].tolist()


EXPECT = {  # ModelConfig fields each architecture must come out with (from either format)
    "qwen2": dict(qkv_bias=True, qk_norm=False, rope_interleaved=False),
    "qwen3": dict(qk_norm=True, head_dim=32, qkv_bias=False, rope_interleaved=False),
    "qwen3_tied": dict(qk_norm=True, tie_embeddings=True),
    "llama3": dict(qk_norm=False),
    "mistral": dict(attn_windows=(8, 8)),
    "mistral_nowindow": dict(attn_windows=()),
    "phi3": dict(attn_windows=(8, 8)),
    "phi3_nowindow": dict(attn_windows=()),
    "falcon": dict(parallel=True, shared_norm=True, n_kv_heads=1, norm="layer", ffn_kind="gelu"),
    "falcon40": dict(parallel=True, shared_norm=False, n_kv_heads=2, attn_bias=True,
                     ffn_bias=True),
    "falcon40_nobias": dict(parallel=True, shared_norm=False, n_kv_heads=2, attn_bias=False),
    "opt350m": dict(post_norm=True, final_norm=False, emb_dim=32, norm="layer", ffn_kind="relu"),
    "gemma2": dict(ffn_kind="geglu_tanh", attn_windows=(8, 0, 8, 0), attn_softcap=2.0,
                   final_softcap=3.0, post_norms=True, scale_embeddings=True, qk_norm=False),
    "gemma3": dict(ffn_kind="geglu_tanh", attn_windows=(8,) * 5 + (0,), rope_theta=1e6,
                   rope_theta_local=10000.0, final_softcap=5.0, qk_norm=True, post_norms=True),
    "mixtral": dict(n_experts=4, n_experts_used=2, experts_norm=True, d_ff=192),
    "qwen3moe": dict(n_experts=4, n_experts_used=2, experts_norm=True, d_ff=96, qk_norm=True),
    "qwen3moe_nonorm": dict(n_experts=4, n_experts_used=2, experts_norm=False),
    "smollm3": dict(nope_layers=(3,), rope_interleaved=True, qk_norm=False),
    "granite": dict(embedding_scale=3.0, residual_scale=0.25, attn_scale=0.0625, logit_scale=4.0,
                    rope_interleaved=True),
    "granitemoe": dict(n_experts=4, n_experts_used=2, experts_norm=True, residual_scale=0.25,
                       logit_scale=4.0),
}


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_tied", "llama3", "mistral", "gemma2",
                                  "gemma3", "phi3", "falcon", "falcon40", "opt350m", "mixtral",
                                  "qwen3moe", "qwen3moe_nonorm", "smollm3", "granite"])
def test_safetensors_match_transformers(arch_model_dir, name):
    lm = load_model(arch_model_dir(name))
    for k, v in EXPECT[name].items():
        if k != "rope_interleaved":
            assert getattr(lm.config, k) == v, k
    if name == "llama3":
        assert lm.config.rope_factors and max(lm.config.rope_factors) == 8.0
    _check(lm, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_tied", "llama3", "mistral_nowindow",
                                  "gemma2", "gemma3", "phi3", "phi3_nowindow", "falcon",
                                  "falcon40_nobias", "mixtral", "qwen3moe", "smollm3",
                                  "granite", "granitemoe"])
def test_llamacpp_gguf_matches_transformers(arch_model_dir, llamacpp_convert, name):
    path = llamacpp_convert(arch_model_dir(name))
    lm = load_model(path)
    assert lm.format == "gguf"
    for k, v in EXPECT[name].items():
        assert getattr(lm.config, k) == v, k
    if name == "llama3":  # the factors come from the file's rope_freqs.weight
        hf = load_model(arch_model_dir(name)).config.rope_factors
        assert torch.allclose(torch.tensor(lm.config.rope_factors), torch.tensor(hf))
    _check(lm, name)


def test_window_mask_in_decode(arch_model_dir):
    """A windowed layer's decode step sees only the last ``window`` keys: logits of one decode
    step equal the full forward's last row past the window."""
    lm = load_model(arch_model_dir("mistral"))
    ids = torch.randint(3, lm.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    full = _ours(lm, ids)[0, -1]
    cache = lm.model.new_cache(1, 21)
    with torch.inference_mode():
        lm.model(ids[:, :19], 0, cache)
        step = lm.model(ids[:, 19:], 19, cache)[0, -1]
    assert _rel_err(step, full) < 1e-5


def test_unsupported_rope_scaling_named(arch_model_dir, tmp_path):
    import json
    import shutil

    from sparseinfer.errors import ModelFileError

    d = tmp_path / "yarn"
    shutil.copytree(arch_model_dir("qwen2"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="rope scaling 'yarn' is not supported"):
        load_model(d)


@pytest.mark.parametrize("name", ["qwen2", "qwen3_tied", "llama3", "mistral", "gemma2", "gemma3",
                                  "phi3", "falcon", "falcon40", "opt350m", "mixtral", "qwen3moe",
                                  "smollm3", "granite"])
def test_bfloat16_safetensors_match_transformers(arch_model_dir, tmp_path, name):
    """The same tiny models saved in bfloat16 (as most checkpoints ship): every projection the
    C kernels take stays BF16 (the plan's default), against transformers in float32 over the
    same bfloat16 numbers; prompt logits and greedy decoding."""
    import shutil

    from sparseinfer.models.build import load
    from sparseinfer.quant.linear import GGMLLinear

    d = tmp_path / name
    shutil.copytree(arch_model_dir(name), d)
    tiny_arch_model(name).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    ref = tiny_arch_model(name)  # its parameters rounded to bfloat16 (not its rope buffers)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    lm = load(d, "auto", kv_type="fp32")
    kinds = {m.type_name for mod in lm.model.modules() if isinstance(mod, GGMLLinear)
             for m in mod.mats}
    assert kinds == {"BF16"}
    ids = torch.randint(3, lm.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    assert _rel_err(_ours(lm, ids), want) < 1e-4
    prompt, n = ids[:1, :5], 12
    with torch.no_grad():
        hf = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert _greedy(lm, prompt, n) == hf[0, prompt.shape[1]:].tolist()
