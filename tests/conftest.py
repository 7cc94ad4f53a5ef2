"""Shared fixtures: tiny random Hugging Face models of every supported architecture and FFN kind
(built offline by transformers from a config, saved as safetensors: they double as the numerical
reference), and the embedded SmolLM2 model, loaded once per session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sparseinfer.data import DEFAULT_CORPUS, default_model_path

TINY_VOCAB = 384
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_KINDS = ("swiglu", "reglu", "drelu", "geglu", "geglu_tanh", "opt")


def _train_tokenizer(out: Path) -> None:
    """A byte-level BPE trained on the default corpus, saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([DEFAULT_CORPUS.read_text()[:200_000]], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "chat_template": TINY_CHAT_TEMPLATE,
    }))


def tiny_hf_model(kind: str, seed: int = 0):
    """A random transformers model of the given FFN kind ('opt' = OPT ReLU MLP)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "opt":
        cfg = tf.OPTConfig(vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=192,
                           num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                           word_embed_proj_dim=64, do_layer_norm_before=True,
                           activation_function="relu", enable_bias=True, init_std=0.1,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return tf.OPTForCausalLM(cfg).eval()
    act = {"swiglu": "silu", "reglu": "relu", "drelu": "relu", "geglu": "gelu",
           "geglu_tanh": "gelu_pytorch_tanh"}[kind]
    cfg = tf.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act=act,
                         initializer_range=0.1, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    if kind == "drelu":
        cfg.sparseinfer_ffn_kind = "drelu"  # dReLU (Bamboo/TurboSparse): relu on gate and up
    model = tf.LlamaForCausalLM(cfg).eval()
    if kind == "drelu":  # transformers has no dReLU MLP: patch the reference's forward
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.forward = (lambda m: lambda x: m.down_proj(
                torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(mlp)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: kind -> directory with config.json, model.safetensors and a tokenizer."""
    made: dict[str, Path] = {}
    tok_dir = tmp_path_factory.mktemp("tiny_tok")
    _train_tokenizer(tok_dir)

    def make(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(f"tiny_{kind}")
            tiny_hf_model(kind).save_pretrained(out, safe_serialization=True)
            for f in tok_dir.iterdir():
                (out / f.name).write_bytes(f.read_bytes())
            made[kind] = out
        return made[kind]

    return make


@pytest.fixture
def with_predictors(tmp_path):
    """Factory: (tiny model dir, seed, rank, drop, dtype) -> a copy with random predictors (their
    weights in ``dtype``), statistics and a placement in ``predictors.safetensors`` (read as the
    file's non-model tensors)."""
    from safetensors.torch import save_file

    def make(path, seed: int = 0, rank: int = 8, drop: str | None = None, dtype=np.float32):
        out = tmp_path / f"{path.name}-pred{seed}-{np.dtype(dtype).name}"
        shutil.copytree(path, out)
        cfg = json.loads((path / "config.json").read_text())
        d_model = cfg["hidden_size"]
        d_ff = cfg.get("intermediate_size") or cfg["ffn_dim"]
        rng = np.random.default_rng(seed)
        t = {}
        for i in range(cfg["num_hidden_layers"]):
            t[f"blk.{i}.fc1.weight"] = rng.standard_normal((rank, d_model))
            t[f"blk.{i}.fc2.weight"] = rng.standard_normal((d_ff, rank))
            t[f"blk.{i}.fc2.bias"] = rng.standard_normal(d_ff)
            t[f"blk.{i}.act_freq"] = np.sort(rng.random(d_ff))[::-1]
            t[f"blk.{i}.gpu_idx"] = (np.arange(d_ff) < d_ff // 3).astype(np.float32)
        t.pop(drop, None)

        def stored(k, v):  # fc1/fc2 in ``dtype``, the rest float32
            weight = k.endswith((".fc1.weight", ".fc2.weight"))
            return torch.from_numpy(np.ascontiguousarray(v, dtype=dtype if weight else np.float32))

        save_file({k: stored(k, v) for k, v in t.items()}, out / "predictors.safetensors")
        return out

    return make


@pytest.fixture
def foreign_arch_dir(tiny_model_dir, tmp_path):
    """Factory: (kind, architecture) -> a copy of that tiny model whose config.json names another
    architecture (the unsupported-architecture cases)."""

    def make(kind: str, arch: str) -> Path:
        out = tmp_path / arch
        shutil.copytree(tiny_model_dir(kind), out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["architectures"] = [arch]
        (out / "config.json").write_text(json.dumps(cfg))
        return out

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our loaded SmolLM2 (fp32), shared by every test of the session."""
    from sparseinfer.models.loading import load_model

    return load_model(smollm2_path, max_seq_len=2048)


_PARSED: dict[tuple, object] = {}  # gguf_parsed_once's readers, for the whole session


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers reads a GGUF as a reference, gguf-py parses each file once instead of
    once for the config, again for the tokenizer and again for the weights (Gemma-3's
    262,144-token vocabulary took 15-30 s a parse here): the same gguf-py reader, handed out
    again while the file is unchanged (for the whole session). Only the references' reads run
    inside; ours subclass the real ``GGUFReader`` and never see this."""
    import gguf

    real = gguf.GGUFReader

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.fspath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in _PARSED:
            _PARSED[key] = real(path, mode)
        return _PARSED[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own load of the same GGUF: the independent reference."""
    import transformers as tf

    with gguf_parsed_once():
        model = tf.AutoModelForCausalLM.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


# ---- architectures beyond llama / OPT (issue #11) -------------------------------------------------

_ARCH_COMMON = dict(vocab_size=TINY_VOCAB + 16, hidden_size=64, intermediate_size=192,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# (vocab padded past the tokenizer, as real models are: Qwen2's tokenizer adds a pad token)
# name -> (transformers config class, model class, config overrides)
TINY_ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "attention_bias": False}),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    # llama.cpp keeps no window for Mistral: the GGUF test uses one no shorter than the context
    "mistral_nowindow": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    # Phi-3: fused qkv and gate_up tensors, a window over every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "sliding_window": 8}),
    "phi3_nowindow": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0,
                                                         "sliding_window": None}),
    # Falcon-7B style: parallel attention + MLP sharing one LayerNorm, one kv head, fused qkv
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(
        multi_query=True, num_kv_heads=1, parallel_attn=True, new_decoder_architecture=False,
        ffn_hidden_size=256, bias=False)),
    # Falcon-40B style: two LayerNorms, grouped kv heads, qkv rows grouped per kv head; biases
    "falcon40": ("FalconConfig", "FalconForCausalLM", dict(
        new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=256, bias=True)),
    # llama.cpp's Falcon converter cannot regroup a qkv bias: its GGUF test goes without
    "falcon40_nobias": ("FalconConfig", "FalconForCausalLM", dict(
        new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=256, bias=False)),
    # OPT-350m layout: norms after the residual adds, no final norm, 32-wide embeddings
    # projected in and out of the 64-wide model (llama.cpp has no OPT: safetensors only)
    "opt350m": ("OPTConfig", "OPTForCausalLM", dict(
        ffn_dim=192, word_embed_proj_dim=32, do_layer_norm_before=False, enable_bias=True,
        activation_function="relu", tie_word_embeddings=True, pad_token_id=0)),
    # Gemma: every other layer windowed (2), soft-capped scores and logits, (1 + w) norms
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        tie_word_embeddings=True, attn_implementation="eager")),
    # Gemma 3: five windowed layers with rope base 10000, then one global with 1e6; q/k norms
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=8, final_logit_softcapping=5.0, tie_word_embeddings=True,
        attn_implementation="eager")),
    # mixtures of experts: 4 experts, 2 a token (Mixtral: each expert intermediate_size wide;
    # Qwen3-MoE: moe_intermediate_size, q/k norms; without norm_topk_prob the picked experts'
    # softmax weights are not renormalized; the tokenizer's vocabulary, so the engine can
    # decode whatever a random model picks)
    # SmolLM3: every 4th layer without rope (no_rope_layers; llama.cpp fixes the 4)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, pad_token_id=0)),
    # Granite: embeddings, residual branches, scores and logits each scaled by its multiplier
    # (values float32 holds exactly: GGUF stores them so)
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, residual_multiplier=0.25, attention_multiplier=0.0625,
        logits_scaling=4.0)),
    # Granite's mixture of experts (GGUF only: its experts are one 3-D tensor per layer in
    # transformers' checkpoints, which are not read)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.25, attention_multiplier=0.0625,
        logits_scaling=4.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)),
    "qwen3moe_nonorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=TINY_VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=False)),
}


def tiny_arch_model(name: str, seed: int = 0):
    """A random transformers model of architecture ``name`` (a key of TINY_ARCHS)."""
    import transformers as tf

    cfg_cls, model_cls, over = TINY_ARCHS[name]
    torch.manual_seed(seed)
    cfg = getattr(tf, cfg_cls)(**{**_ARCH_COMMON, **over})
    model = getattr(tf, model_cls)(cfg).eval()
    # random norm weights, so a norm read from the wrong place (or not at all) shows
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 and n.endswith(".weight"):  # norms (Falcon's ln_attn too)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def arch_model_dir(tiny_model_dir, tmp_path_factory):
    """Factory: architecture name -> directory with config.json, safetensors and a tokenizer."""
    made: dict[str, Path] = {}
    tok_src = tiny_model_dir("swiglu")

    def make(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"tiny_{name}")
            tiny_arch_model(name).save_pretrained(out, safe_serialization=True)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                (out / f).write_bytes((tok_src / f).read_bytes())
            made[name] = out
        return made[name]

    return make


LLAMACPP_SDIST = "llama-cpp-python==0.3.36"
# llama.cpp's converter hashes the tokenizer's output to name its pre-tokenizer and refuses ones
# it does not know (ours is a tiny trained BPE): call it "default" and convert
_CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
from conversion import gemma, phi  # these read only sentencepiece vocabularies; ours is BPE
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="session")
def llamacpp_convert(tmp_path_factory):
    """llama.cpp's own ``convert_hf_to_gguf.py`` (from the llama-cpp-python source distribution,
    with its bundled gguf-py): an independent GGUF writer. Returns hf_dir -> GGUF path."""
    import subprocess
    import sys
    import tarfile

    dl = tmp_path_factory.mktemp("lcpp")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", LLAMACPP_SDIST, "-d", str(dl)], capture_output=True, text=True,
                       timeout=540)
    tars = list(dl.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode or not tars:
        pytest.skip(f"cannot download {LLAMACPP_SDIST} from PyPI (llama.cpp's converter): "
                    f"{r.stderr.strip().splitlines()[-1:] }")
    with tarfile.open(tars[0]) as tf_:
        members = [m for m in tf_.getmembers()
                   if "/vendor/llama.cpp/" in m.name and ("/gguf-py/" in m.name
                                                         or "/conversion/" in m.name
                                                         or m.name.endswith("convert_hf_to_gguf.py"))]
        tf_.extractall(dl, members=members, filter="data")
    root = next(dl.glob("llama_cpp_python-*/vendor/llama.cpp"))

    def convert(hf_dir: Path, outtype: str = "f32") -> Path:
        out = hf_dir / f"model-{outtype}.gguf"
        if not out.exists():
            r = subprocess.run([sys.executable, "-c", _CONVERT, str(root / "gguf-py"), str(root),
                                str(hf_dir), "--outtype", outtype, "--outfile", str(out)],
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stderr[-3000:]}")
        return out

    return convert
