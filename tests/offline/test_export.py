"""The sparse GGUF: dense logits equal the source's (every tiny kind, and SmolLM2), the file
reads back with gguf's reader, neurons are hot-first, the extras are there; error cases."""

from __future__ import annotations

from dataclasses import replace

import json
import os
import subprocess
import sys
from sparseinfer.config import ModelConfig

import numpy as np
import pytest
import torch

from sparseinfer.errors import ModelFileError, SparseInferError
from sparseinfer.models.loading import load_model
from sparseinfer.offline.export import (ExportOptions, check_output_path, export_sparse_gguf,
                                        hot_first_permutations)
from sparseinfer.offline.pipeline import (ConvertOptions, convert, placement_inputs, run_profile,
                                          run_solve, run_train)
from sparseinfer.offline.profile import ProfileOptions
from sparseinfer.offline.train import TrainOptions

TINY_KINDS = ("swiglu", "reglu", "drelu", "geglu", "opt")
FAST_TRAIN = TrainOptions(ranks=(4,), epochs=2, min_steps=40)
PROMPT = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy"


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key):
    return reader.fields[key].contents()


def _logits(lm, ids):
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), 0, lm.model.new_cache(1, len(ids)))[0]


@pytest.fixture(scope="module")
def tiny_exports(tiny_model_dir, tmp_path_factory):
    """kind -> (source dir, exported GGUF, profile, predictors, placement), built once."""
    made = {}

    def make(kind):
        if kind not in made:
            src = tiny_model_dir(kind)
            out = tmp_path_factory.mktemp(f"export_{kind}")
            lm = load_model(src)
            prof = run_profile(lm, [_corpus()], out / "profile",
                               ProfileOptions(chunk_len=128, max_tokens=1024, min_tokens=1))
            preds = run_train(prof, FAST_TRAIN)
            nb, parts = placement_inputs(lm, prof, preds, ctx=64)
            # room for the dense parts and about a third of the neurons
            budget = sum(b for _, b in parts) + nb[0] * lm.config.d_ff * lm.config.n_layers // 3
            placement = run_solve(lm, prof, preds, budget, ctx=64, group_size=16,
                                  min_split_neurons=32)
            export_sparse_gguf(lm, prof, preds, out / "sparse.gguf", placement)
            made[kind] = (src, out / "sparse.gguf", prof, preds, placement)
        return made[kind]

    return make


def _corpus():
    from sparseinfer.data import DEFAULT_CORPUS

    return DEFAULT_CORPUS


@pytest.mark.parametrize("kind", [k if k == "reglu" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in TINY_KINDS])
def test_dense_logits_equal_the_source(tiny_exports, kind):
    import transformers as tf

    src, out, *_ = tiny_exports(kind)
    source, sparse = load_model(src), load_model(out)
    # the GGUF keeps llama.cpp's Q/K row order, read with rope over adjacent pairs
    assert replace(sparse.config, rope_interleaved=False) == source.config
    ids = source.tokenizer.encode(PROMPT)
    assert sparse.tokenizer.encode(PROMPT) == ids
    assert sparse.tokenizer.chat_template == source.tokenizer.chat_template
    assert (sparse.tokenizer.bos_id, sparse.tokenizer.eos_id) == \
        (source.tokenizer.bos_id, source.tokenizer.eos_id)
    got = _logits(sparse, ids)
    torch.testing.assert_close(got, _logits(source, ids), atol=1e-4, rtol=1e-4)
    if kind != "drelu":  # transformers has no dReLU MLP; the other kinds are its own models
        ref = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["swiglu", "opt"])
def test_layout_hot_first_and_extras(tiny_exports, kind):
    from safetensors.numpy import load_file

    src, out, prof, preds, placement = tiny_exports(kind)
    r = _reader(out)
    t = {x.name: x for x in r.tensors}
    cfg = load_model(out).config
    L, D, F = cfg.n_layers, cfg.d_model, cfg.d_ff
    hf = load_file(str(src / "model.safetensors"))
    up_name = ("model.decoder.layers.{}.fc1.weight" if kind == "opt"
               else "model.layers.{}.mlp.up_proj.weight")
    down_name = ("model.decoder.layers.{}.fc2.weight" if kind == "opt"
                 else "model.layers.{}.mlp.down_proj.weight")
    assert ModelConfig(**json.loads(_field(r, "sparseinfer.config"))) == cfg  # JSON: lists
    assert _field(r, "sparseinfer.ffn_kind") == cfg.ffn_kind
    assert _field(r, "powerinfer.sparse_threshold") == 0.0
    assert _field(r, "sparseinfer.sparsity.mode") == ("relu" if kind == "opt" else "magnitude")
    assert len(_field(r, "sparseinfer.sparsity.layer_thresholds")) == L
    assert _field(r, "sparseinfer.predictor.ranks") == [p.rank for p in preds.layers]
    assert _field(r, "sparseinfer.placement.hot_counts") == list(placement.hot_counts)
    assert sum(placement.hot_counts) > 0
    for l in range(L):
        freq = np.asarray(t[f"blk.{l}.act_freq"].data)
        assert np.all(np.diff(freq) <= 0)  # hot first
        perm = hot_first_permutations(prof.freqs)[l]
        np.testing.assert_allclose(freq, prof.freqs[l][perm], rtol=1e-6)
        # rows of up, rows of the transposed down: the source's, permuted (PyTorch shapes)
        up = np.asarray(t[f"blk.{l}.ffn_up.weight"].data)
        np.testing.assert_array_equal(up, hf[up_name.format(l)][perm])
        down_t = np.asarray(t[f"blk.{l}.ffn_down_t.weight"].data)
        assert down_t.shape == (F, D)
        np.testing.assert_array_equal(down_t, hf[down_name.format(l)].T[perm])
        # predictors: fc1 [r, D], fc2 [F, r] rows permuted with the neurons
        p = preds.layers[l]
        np.testing.assert_array_equal(np.asarray(t[f"blk.{l}.fc1.weight"].data), p.fc1)
        np.testing.assert_array_equal(np.asarray(t[f"blk.{l}.fc2.weight"].data), p.fc2[perm])
        np.testing.assert_array_equal(np.asarray(t[f"blk.{l}.fc2.bias"].data), p.bias[perm])
        # placement: the solver's hottest neurons are the first k after the permutation
        k = placement.hot_counts[l]
        idx = np.asarray(t[f"blk.{l}.gpu_idx"].data)
        assert idx.dtype == np.int32 and idx.shape == (F,) and idx.sum() == k
        if k:
            np.testing.assert_array_equal(np.asarray(t[f"blk.{l}.gpu_bucket"].data),
                                          np.arange(k))
            np.testing.assert_array_equal(idx[:k], 1)
        else:
            assert f"blk.{l}.gpu_bucket" not in t  # GGUF has no empty tensors


def test_gguf_dump_reads_it(tiny_exports):
    _, out, *_ = tiny_exports("reglu")
    res = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_dump", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "blk.0.ffn_down_t.weight" in res.stdout and "blk.1.gpu_idx" in res.stdout
    assert "sparseinfer.sparsity.mode" in res.stdout


def test_f16_outtype(tiny_exports, tmp_path):
    from gguf import GGMLQuantizationType as Q

    src, _, prof, preds, _ = tiny_exports("swiglu")
    lm = load_model(src)
    export_sparse_gguf(lm, prof, preds, tmp_path / "h.gguf", None, ExportOptions(outtype="f16"))
    t = {x.name: x for x in _reader(tmp_path / "h.gguf").tensors}
    assert t["blk.0.ffn_down_t.weight"].tensor_type == Q.F16
    assert t["blk.0.fc1.weight"].tensor_type == Q.F16
    assert t["blk.0.fc2.bias"].tensor_type == Q.F32 and t["blk.0.attn_norm.weight"].tensor_type \
        == Q.F32
    assert "blk.0.gpu_bucket" not in t and int(np.asarray(t["blk.0.gpu_idx"].data).sum()) == 0
    ids = lm.tokenizer.encode(PROMPT)
    torch.testing.assert_close(_logits(load_model(tmp_path / "h.gguf"), ids), _logits(lm, ids),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_smollm2_round_trip(smollm2, smollm2_path, tmp_path):
    from gguf import GGMLQuantizationType as Q

    torch.set_num_threads(2)
    options = ConvertOptions(
        profile=ProfileOptions(chunk_len=128, max_tokens=256, min_tokens=1),
        train=TrainOptions(ranks=(8,), epochs=1, min_steps=10))
    out = tmp_path / "smol.gguf"
    report = convert(smollm2_path, out, options, loaded=smollm2)
    assert report.output.path == out and report.placement is None
    r, source = _reader(out), _reader(smollm2_path)
    t = {x.name: x for x in r.tensors}
    src = {x.name: x for x in source.tensors}
    # quantized gate/up rows are copied block for block, permuted; down_t is lossless F32
    perm = hot_first_permutations(report.profile.freqs)[3]
    assert t["blk.3.ffn_gate.weight"].tensor_type == src["blk.3.ffn_gate.weight"].tensor_type
    np.testing.assert_array_equal(np.asarray(t["blk.3.ffn_gate.weight"].data),
                                  np.asarray(src["blk.3.ffn_gate.weight"].data)[perm])
    assert t["blk.3.ffn_down_t.weight"].tensor_type == Q.F32
    assert t["token_embd.weight"].tensor_type == src["token_embd.weight"].tensor_type
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert _field(r, key) == _field(source, key)
    sparse = load_model(out, max_seq_len=2048)
    ids = smollm2.tokenizer.encode(PROMPT)
    assert sparse.tokenizer.encode(PROMPT) == ids
    torch.testing.assert_close(_logits(sparse, ids), _logits(smollm2, ids), atol=1e-3, rtol=1e-4)


# ---- errors ------------------------------------------------------------------------------------


def test_unknown_architecture(foreign_arch_dir, tmp_path):
    bad = foreign_arch_dir("reglu", "GPT2LMHeadModel")
    with pytest.raises(ModelFileError, match="unsupported architecture 'GPT2LMHeadModel'"):
        convert(bad, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_output_path_checks(tmp_path):
    with pytest.raises(SparseInferError, match="output directory does not exist"):
        check_output_path(tmp_path / "missing" / "out.gguf")
    (tmp_path / "file").write_text("")
    with pytest.raises(SparseInferError, match="output directory does not exist"):
        check_output_path(tmp_path / "file" / "out.gguf")
    with pytest.raises(SparseInferError, match="expected a file name, found a directory"):
        check_output_path(tmp_path)
    assert check_output_path(tmp_path / "ok.gguf") == tmp_path / "ok.gguf"
    assert os.listdir(tmp_path) == ["file"]  # the probe left nothing


def test_failure_mid_write_leaves_nothing(tiny_exports, tmp_path, monkeypatch):
    import sparseinfer.offline.export as export

    src, _, prof, preds, _ = tiny_exports("reglu")
    lm = load_model(src)
    real = export.plan_sparse_tensors

    def broken(*a, **k):
        tensors = real(*a, **k)

        def boom():
            raise OSError(28, "No space left on device")

        tensors[-1].make = boom
        return tensors

    monkeypatch.setattr(export, "plan_sparse_tensors", broken)
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")  # an older file under that name survives untouched
    with pytest.raises(SparseInferError, match="cannot write: No space left"):
        export_sparse_gguf(lm, prof, preds, out)
    assert out.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["out.gguf"]


def test_budget_smaller_than_dense_parts(tiny_exports):
    src, _, prof, preds, _ = tiny_exports("reglu")
    lm = load_model(src)
    _, parts = placement_inputs(lm, prof, preds, ctx=64)
    assert [n for n, _ in parts] == ["embeddings", "kv_cache", "attention", "predictors", "norms"]
    with pytest.raises(SparseInferError, match="budget too small"):
        run_solve(lm, prof, preds, sum(b for _, b in parts) - 1, ctx=64)


def test_mismatched_profile(tiny_exports, tmp_path):
    _, _, prof, preds, _ = tiny_exports("reglu")
    other = load_model(tiny_exports("opt")[0])
    with pytest.raises(SparseInferError, match="expected a profile of this model|FFN kind"):
        export_sparse_gguf(other, prof, preds, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_export_releases_source_pages_and_writes_the_same_bytes(tiny_exports, tmp_path,
                                                                  monkeypatch):
    """Every tensor read from a GGUF source's map has its pages released once written (peak
    RSS of a big convert), and the file is byte for byte the one written without releasing."""
    import sparseinfer.fileio as fileio
    from sparseinfer.models.loading import gguf_model_tensors

    _, sparse, prof, preds, placement = tiny_exports("reglu")
    lm = load_model(sparse)  # a GGUF source (down_t included): its tensors come from the map
    calls = []
    real = fileio.drop_pages

    def spy(arr):
        calls.append((arr.__array_interface__["data"][0], arr.nbytes))
        real(arr)

    monkeypatch.setattr(fileio, "drop_pages", spy)
    export_sparse_gguf(lm, prof, preds, tmp_path / "a.gguf", placement)
    raw = gguf_model_tensors(lm)
    assert raw
    for t in raw.values():
        data = np.asarray(t.data)
        assert (data.__array_interface__["data"][0], data.nbytes) in calls, t.name
    monkeypatch.setattr(fileio, "drop_pages", lambda arr: None)
    export_sparse_gguf(lm, prof, preds, tmp_path / "b.gguf", placement)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
