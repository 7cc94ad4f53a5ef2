"""PowerInfer's own model files: tiny files in the layout its converter
(`convert-hf-to-powerinfer-gguf.py`) writes — magic b"PWRI", checkpoint-order Q/K rows, down
projection transposed as ``ffn_down_t``, predictors ``blk.N.fc1/fc2`` (fc1 → ReLU → fc2, no
bias), ``powerinfer.sparse_threshold`` — written here with gguf-py from tiny transformers models,
which are the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer.cli import main
from sparseinfer.models.build import load
from sparseinfer.models.loading import open_source
from sparseinfer.sparse.runtime import sparse_info

IDS = [1, 17, 42, 99, 123, 7, 250, 31, 64, 300]
RANK = 8
# HF name -> PowerInfer's GGUF name (llama and OPT)
LLAMA = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
         "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
OPT = {"model.decoder.embed_tokens": "token_embd",
       "model.decoder.embed_positions": "position_embd",
       "model.decoder.final_layer_norm": "output_norm", "lm_head": "output",
       "self_attn_layer_norm": "attn_norm", "self_attn.q_proj": "attn_q",
       "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
       "self_attn.out_proj": "attn_output", "final_layer_norm": "ffn_norm", "fc1": "ffn_up",
       "fc2": "ffn_down"}


def _gguf_name(hf: str, table: dict[str, str]) -> str:
    base, suffix = hf.rsplit(".", 1)
    for prefix in ("model.layers.", "model.decoder.layers."):
        if base.startswith(prefix):
            i, rest = base[len(prefix):].split(".", 1)
            return f"blk.{i}.{table[rest]}.{suffix}"
    return f"{table[base]}.{suffix}"


def write_powerinfer_file(src, out, kind: str, ftype: str = "f32", threshold: float = 0.0,
                          seed: int = 0):
    """A PowerInfer-layout file of the tiny HF model in ``src`` (kind "reglu" or "opt")."""
    import gguf
    from safetensors.torch import load_file

    from sparseinfer.offline.export import hf_tokenizer_fields
    from sparseinfer.tokenizer import Tokenizer
    import json

    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    arch = "opt" if kind == "opt" else "llama"
    table = OPT if kind == "opt" else LLAMA
    w = gguf.GGUFWriter(str(out), arch)
    D, L, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    F = cfg.get("intermediate_size") or cfg["ffn_dim"]
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    if arch == "llama":
        w.add_context_length(2048)
        w.add_rope_dimension_count(D // H)
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    else:
        w.add_context_length(2050)
    w.add_float32("powerinfer.sparse_threshold", threshold)
    tok = Tokenizer.from_hf_dir(src)
    for key, (value, vt, sub) in hf_tokenizer_fields(src, tok, cfg["vocab_size"]).items():
        w.add_key_value(key, value, vt, sub_type=sub)
    rng = np.random.default_rng(seed)
    preds = {}
    for i in range(L):  # predictors first, as the converter writes them
        preds[f"blk.{i}.fc1.weight"] = rng.standard_normal((RANK, D)).astype(np.float32)
        preds[f"blk.{i}.fc2.weight"] = rng.standard_normal((F, RANK)).astype(np.float32)
    tensors = dict(preds)
    for name, t in state.items():
        new = _gguf_name(name, table)
        data = t.float().numpy()
        if "ffn_down" in new:  # transposed for PowerInfer's axpy
            new, data = new.replace("ffn_down", "ffn_down_t"), data.T
        tensors[new] = np.ascontiguousarray(data)
    if "output.weight" not in tensors and not cfg.get("tie_word_embeddings", True):
        raise AssertionError("expected an lm_head")
    for name, data in tensors.items():
        if ftype == "f16" and data.ndim == 2 and name.endswith(".weight"):
            data = data.astype(np.float16)
        if ftype == "q4_0" and data.ndim == 2 and ".fc" not in name and "embd" not in name:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            continue
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(out, "r+b") as f:  # PowerInfer's converter overwrites the magic
        f.write(b"PWRI")
    return out, preds


@pytest.fixture(scope="module")
def pwri(tiny_model_dir, tmp_path_factory):
    made = {}

    def make(kind: str = "reglu", ftype: str = "f32"):
        if (kind, ftype) not in made:
            out = tmp_path_factory.mktemp("pwri") / f"tiny-{kind}.{ftype}.powerinfer.gguf"
            made[kind, ftype] = write_powerinfer_file(tiny_model_dir(kind), out, kind, ftype)
        return made[kind, ftype]

    return make


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(torch.tensor([ids]), 0, model.new_cache(1, len(ids)))[0]


def _decode_logits(model, ids=IDS):
    """Token by token (each token its own predicted set, on both tiers)."""
    cache = model.new_cache(1, len(ids))
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([[t]]), i, cache)[0, -1]
                            for i, t in enumerate(ids)])


def _hf_logits(path, ids=IDS):
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["reglu", "opt"])
@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_powerinfer_file_equals_the_source_model(pwri, tiny_model_dir, kind, ftype):
    """Magic PWRI loads; the FFN is ReLU-family; all neurons active (and --dense) give
    transformers' logits on the source HF model."""
    path, _ = pwri(kind, ftype)
    src = open_source(path)
    assert src.powerinfer and src.config.ffn_kind == ("reglu" if kind == "reglu" else "relu")
    want = _hf_logits(tiny_model_dir(kind))
    tol = 1e-4 if ftype == "f32" else 2e-2
    # a float32 KV cache, as transformers' (the default's float16 one moves these ~5e-4)
    dense = load(path, "auto", dense=True, kv_type="fp32")
    assert _rel(_logits(dense.model), want) < tol
    lm = load(path, "auto", threshold=-float("inf"), kv_type="fp32")
    info = sparse_info(lm.model, lm.plan)
    assert info is not None and info.mode == "predictor"
    assert _rel(_logits(lm.model), want) < tol
    assert info.density() == 1.0


def test_predictors_follow_powerinfers_rule(pwri):
    """Neuron i is computed iff fc2 · relu(fc1 · r) >= powerinfer.sparse_threshold, where r is
    the residual stream entering the FFN (PowerInfer's ``ffn_inp``), before the FFN's norm."""
    path, preds = pwri("reglu")
    lm = load(path, "auto")
    ffn = lm.model.layers[0].ffn
    seen = {}
    orig = ffn.forward

    def spy(x, residual=None):
        seen["x"], seen["r"] = x.clone(), residual.clone()
        return orig(x, residual)

    ffn.forward = spy
    _logits(lm.model, IDS[:1])
    r = seen["r"].reshape(-1)
    # it is the pre-norm residual: the FFN norm of r is the FFN's input
    torch.testing.assert_close(lm.model.layers[0].ffn_norm(r), seen["x"].reshape(-1))
    fc1, fc2 = preds["blk.0.fc1.weight"], preds["blk.0.fc2.weight"]
    for t in (0.0, -1.0, 2.0):
        ffn.selector.predictor.threshold = t
        z = fc2 @ np.maximum(fc1 @ r.numpy(), 0)
        want = np.nonzero(z >= t)[0]
        got = ffn.active(seen["x"].reshape(-1).float(), r).numpy()
        np.testing.assert_array_equal(got, want)
        assert 0 < len(want) < ffn.d_ff


def test_info_says_powerinfer(pwri, capsys):
    path, _ = pwri("reglu")
    assert main(["info", "-m", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PowerInfer" in out and "powerinfer.sparse_threshold" in out


def _gpu_index(path, masks):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for i, m in enumerate(masks):
        w.add_tensor(f"blk.{i}.gpu_idx", m.astype(np.int32))
        w.add_tensor(f"blk.{i}.gpu_bucket", np.nonzero(m)[0].astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gpu_index_is_a_placement(pwri, tmp_path, caplog):
    """A PowerInfer GPU index becomes the fast tier's neurons (CPU standing in for the GPU):
    same logits as one tier; on a CPU-only run it is ignored with a warning."""
    path, _ = pwri("reglu")
    cfg = open_source(path).config
    rng = np.random.default_rng(3)
    masks = [rng.random(cfg.d_ff) < 0.3 for _ in range(cfg.n_layers)]
    index = _gpu_index(tmp_path / "gpu.idx", masks)
    one = load(path, "auto")
    two = load(path, "auto", split_tiers=True, gpu_index=str(index))
    assert list(two.plan.sparse.hot_counts) == [int(m.sum()) for m in masks]
    assert all(b.ffn.split for b in two.model.layers)
    assert _rel(_decode_logits(two.model), _decode_logits(one.model)) < 1e-5
    with caplog.at_level("WARNING"):
        cpu = load(path, "auto", gpu_index=str(index))
    assert "ignored" in caplog.text and cpu.plan.sparse.gpu_index is None


@pytest.mark.slow
def test_convert_reprofiles_a_powerinfer_file(pwri, tmp_path, capsys):
    """Our convert adds statistics, our predictors and a placement to a PowerInfer file."""
    path, _ = pwri("reglu")
    out = tmp_path / "re.sparse.gguf"
    fast = ["--max-tokens", "512", "--chunk-len", "64", "--ranks", "4", "--epochs", "2",
            "-t", "1"]
    assert main(["convert", "-m", str(path), "-o", str(out), *fast]) == 0
    src = open_source(out)
    assert not src.powerinfer and "blk.0.act_freq" in src.extras
    assert src.extra_array("blk.0.fc1.weight").shape[0] == 4  # our rank, not PowerInfer's
    capsys.readouterr()
    assert main(["run", "-m", str(out), "-p", "Emma", "-n", "4", "--temp", "0"]) == 0
    assert "sparse FFN" in capsys.readouterr().err


def test_q4_0_file_gates_stay_4_bit(pwri, tmp_path, capsys):
    """A ReGLU file whose gates and ups are Q4_0: the file's gate rows are kept apart as q4 rows
    (its bytes, moved) and each neuron's bundle holds its up row as a q4 row (its bytes too) and
    its int8 down row (dtype "q4i8"); the kernels take them for one token
    (``sparse_ffn_i8_q4g``) and a prompt (``sparse_ffn_i8``) alike; all neurons active, near
    the file's dense function (as the test below bounds the default); ``q4_ups=False`` makes
    int8 up rows, ``q4_gates=False`` (``--no-q4-gates``) int8 gate rows too, the plan that much
    larger each time."""
    from sparseinfer.sparse.packed import q4_rows, q4i8_layout

    path, _ = pwri("reglu", "q4_0")
    lm = load(path, "auto", threshold=-float("inf"))
    gates = load(path, "auto", threshold=-float("inf"), q4_ups=False)
    off = load(path, "auto", threshold=-float("inf"), q4_gates=False)
    cfg = lm.plan.config
    assert lm.plan.sparse.q4_ups and not gates.plan.sparse.q4_ups
    assert gates.plan.sparse.q4_gates and not off.plan.sparse.q4_gates
    assert not off.plan.sparse.q4_ups  # (ups apart only with the gates)
    assert "q4 gates and ups" in lm.plan.summary() and "ups" not in gates.plan.summary()
    assert "q4 gates" in gates.plan.summary() and "q4 gates" not in off.plan.summary()
    for flags, rows in (([], "int8 rows, q4 gates and ups"), (["--no-q4-ups"], "int8 rows, q4 "
                        "gates"), (["--no-q4-gates"], "int8 rows")):  # the CLI's plans
        assert main(["info", "-m", str(path), *flags]) == 0
        assert f"sparse FFN (predictor, {rows})" in capsys.readouterr().out
    D = cfg.d_model  # an int8 row: D bytes and D / 32 float32 scales; a q4 row: 18 per 32
    saved = cfg.n_layers * cfg.d_ff * (D + D // 32 * 4 - D // 32 * 18)
    assert off.plan.nbytes - gates.plan.nbytes == saved
    assert gates.plan.nbytes - lm.plan.nbytes == saved
    src = open_source(path)
    lay = q4i8_layout(D, 32)

    def file_rows(i, name):
        raw = np.asarray(src.tensors[f"layers.{i}.ffn.{name}.weight"].raw())
        return q4_rows(torch.from_numpy(raw.reshape(cfg.d_ff, -1).copy()))

    for i, blk in enumerate(lm.model.layers):
        p, g = blk.ffn.packed, gates.model.layers[i].ffn.packed
        assert p.dtype == "q4i8" and torch.equal(p.gates, file_rows(i, "gate"))
        assert torch.equal(p.rows[:, 0, lay.up:lay.down], file_rows(i, "up"))
        assert g.dtype == "int8" and g.stored_mats == 2 and torch.equal(g.gates, p.gates)
        assert torch.equal(p.rows_fp32()[:, 2], g.rows_fp32()[:, 2])  # the same int8 down rows
        assert off.model.layers[i].ffn.packed.gates is None
    exact = _logits(load(path, "fp32", dense=True).model)
    for m in (lm, gates, off):
        assert _rel(_decode_logits(m.model), exact) < 0.05
    assert _rel(_logits(lm.model), exact) < 0.05
    # two tiers (CPU standing in for the fast device): the hot neurons' torch path reads the
    # gates apart through rows_fp32, on x as it is (the C kernels round it)
    rng = np.random.default_rng(4)
    masks = [rng.random(cfg.d_ff) < 0.3 for _ in range(cfg.n_layers)]
    two = load(path, "auto", threshold=-float("inf"), split_tiers=True,
               gpu_index=str(_gpu_index(tmp_path / "gpu.idx", masks)))
    assert all(b.ffn.split and b.ffn.hot.gates is not None for b in two.model.layers)
    assert _rel(_decode_logits(two.model), exact) < 0.05


def test_q4_0_powerinfer_file(pwri):
    """A PowerInfer file with Q4_0 matrices (as its quantizer writes them): the dense parts run
    on the file's blocks, the FFN rows are its dequantized blocks; all neurons active equals the
    dense model of the same file (4-bit rounding of a random tiny model is far from its float
    source, so that is not compared)."""
    path, _ = pwri("reglu", "q4_0")
    lm = load(path, "auto", threshold=-float("inf"))
    assert lm.plan.weight("layers.0.attn.wqkv").storage == "ggml"
    exact = load(path, "fp32", dense=True)  # every block dequantized: the file's function
    assert _rel(_logits(load(path, "fp32", threshold=-float("inf")).model),
                _logits(exact.model)) < 1e-4
    # the default rounds activations to int8 blocks for the file's 4-bit blocks
    assert _rel(_logits(lm.model), _logits(exact.model)) < 0.05
