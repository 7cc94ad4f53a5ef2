"""Profiling and calibration: frequencies against transformers' own activations, the streamed
files, bounded memory, calibrated density, and the corpus checks."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from sparseinfer.data import DEFAULT_CORPUS
from sparseinfer.errors import SparseInferError
from sparseinfer.models.loading import load_model
from sparseinfer.offline.calibrate import (ScoreHistogram, calibrate_thresholds,
                                           oracle_sparsity, run_chunks)
from sparseinfer.offline.profile import (ProfileOptions, corpus_chunks, load_profile,
                                         profile_model, read_corpus)

TEXT = DEFAULT_CORPUS.read_text()[:60_000]


def _chunks(tok, n_tokens, chunk_len=128):
    return corpus_chunks(tok, [TEXT], chunk_len, n_tokens, min_tokens=1)


def _hf_reference(path, kind):
    """transformers' model of the same directory, with hooks capturing each MLP's coefficients
    (the input of the down projection) and the MLP input."""
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if kind == "opt":
        layers = ref.model.decoder.layers
        downs = [layer.fc2 for layer in layers]
        ins = [layer.fc1 for layer in layers]
    else:
        layers = ref.model.layers
        if kind == "drelu":  # transformers has no dReLU MLP (see conftest.tiny_hf_model)
            for layer in layers:
                m = layer.mlp
                m.forward = (lambda m: lambda x: m.down_proj(
                    torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(m)
        downs = [layer.mlp.down_proj for layer in layers]
        ins = [layer.mlp.gate_proj for layer in layers]
    seen: dict[str, list] = {"h": [[] for _ in layers], "x": [[] for _ in layers]}
    for i, (d, g) in enumerate(zip(downs, ins)):
        # (B, T, n) for llama, (B * T, n) for OPT: keep (tokens, n)
        d.register_forward_pre_hook(
            lambda mod, args, i=i: seen["h"][i].append(args[0].reshape(-1, args[0].shape[-1])))
        g.register_forward_pre_hook(
            lambda mod, args, i=i: seen["x"][i].append(args[0].reshape(-1, args[0].shape[-1])))
    return ref, seen


@pytest.mark.parametrize("kind", ["reglu", "opt", "drelu"])
def test_relu_frequencies_match_transformers(tiny_model_dir, tmp_path, kind):
    path = tiny_model_dir(kind)
    lm = load_model(path)
    chunks = _chunks(lm.tokenizer, 1024)
    prof = profile_model(lm.model, chunks, tmp_path / "p", ProfileOptions(min_tokens=1))
    assert prof.mode == "relu" and prof.n_tokens == 1024

    ref, seen = _hf_reference(path, kind)
    with torch.no_grad():
        for c in chunks:
            ref(torch.tensor([c]))
    for l in range(lm.config.n_layers):
        h = torch.cat(seen["h"][l])  # (T, d_ff)
        brute = (h != 0).sum(0).numpy()
        np.testing.assert_array_equal(prof.counts[l], brute)
        np.testing.assert_allclose(prof.freqs[l], brute / 1024)
        # the stored masks are the same per-token sets, the inputs the MLP's inputs (fp16)
        np.testing.assert_array_equal(prof.masks(l), (h != 0).numpy())
        x = torch.cat(seen["x"][l]).numpy()
        np.testing.assert_allclose(prof.inputs(l).astype(np.float32), x, rtol=2e-3, atol=2e-3)


def test_streamed_files(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir("reglu"))
    cfg = lm.config
    chunks = _chunks(lm.tokenizer, 700)  # 5 full chunks of 128 and a partial one of 60
    assert [len(c) for c in chunks] == [128] * 5 + [60]
    prof = profile_model(lm.model, chunks, tmp_path / "p", ProfileOptions(min_tokens=1))
    again = load_profile(tmp_path / "p")
    assert again.n_tokens == prof.n_tokens == 700
    assert again.chunk_lens == prof.chunk_lens
    np.testing.assert_array_equal(again.counts, prof.counts)
    for l in range(cfg.n_layers):
        x, m = again.inputs(l), again.packed_masks(l)
        assert isinstance(x, np.memmap) and isinstance(m, np.memmap)
        assert x.shape == (700, cfg.d_model) and x.dtype == np.float16
        assert m.shape == (700, (cfg.d_ff + 7) // 8) and m.dtype == np.uint8
        np.testing.assert_array_equal(again.masks(l).sum(0), prof.counts[l])
    assert 0.0 < prof.densities.mean() < 1.0


def test_magnitude_masks_match_transformers(tiny_model_dir, tmp_path):
    """SwiGLU, "output" score: the stored masks are |h| > t_l for transformers' own coefficients
    h, up to the float16 rounding of the stored scores (a mask may differ only where |h| is
    within 2**-10 of t_l); no score files are left behind."""
    path = tiny_model_dir("swiglu")
    lm = load_model(path)
    chunks = _chunks(lm.tokenizer, 512)
    opts = ProfileOptions(target_density=0.4, score="output", min_tokens=1)
    prof = profile_model(lm.model, chunks, tmp_path / "p", opts)
    assert prof.mode == "magnitude" and not list((tmp_path / "p").glob("score_*"))
    ref, seen = _hf_reference(path, "swiglu")
    with torch.no_grad():
        for c in chunks:
            ref(torch.tensor([c]))
    for l in range(lm.config.n_layers):
        score = torch.cat(seen["h"][l]).abs().numpy()
        t = float(prof.thresholds[l])
        want, got = score > t, prof.masks(l)
        differ = want != got
        assert differ.mean() < 1e-3
        assert np.all(np.abs(score[differ] - t) <= 2.0 ** -10 * t)
        np.testing.assert_array_equal(prof.counts[l], got.sum(0))


@pytest.mark.slow
def test_memory_bounded_by_chunk_not_corpus(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir("reglu"))
    cfg = lm.config
    peaks = {}
    for n in (1024, 8192):
        chunks = _chunks(lm.tokenizer, n, chunk_len=256)
        tracemalloc.start()
        prof = profile_model(lm.model, chunks, tmp_path / f"p{n}", ProfileOptions(min_tokens=1))
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert prof.n_tokens == n  # the token limit is honoured exactly
    on_disk = 8192 * cfg.n_layers * (2 * cfg.d_model + (cfg.d_ff + 7) // 8)
    assert peaks[8192] < 0.25 * on_disk  # nothing proportional to the corpus is held
    assert peaks[8192] < peaks[1024] + 0.1 * on_disk


@pytest.mark.parametrize("kind,score", [("swiglu", "output"),
                                        pytest.param("geglu", "output_norm", marks=pytest.mark.slow)])
def test_calibrated_density(tiny_model_dir, tmp_path, kind, score):
    lm = load_model(tiny_model_dir(kind))
    chunks = _chunks(lm.tokenizer, 2048)
    opts = ProfileOptions(target_density=0.3, score=score, min_tokens=1)
    prof = profile_model(lm.model, chunks, tmp_path / "p", opts)
    assert prof.mode == "magnitude"
    np.testing.assert_allclose(prof.densities, 0.3, atol=0.01)
    # the same thresholds through a different path: the oracle-masked model on those tokens
    dens: dict[int, list[float]] = {}
    with oracle_sparsity(lm.model, prof.thresholds, score, dens):
        run_chunks(lm.model, chunks)
    for l, d in dens.items():
        lens = [len(c) for c in chunks]
        assert abs(np.average(d, weights=lens) - 0.3) < 0.01
    # calibrate_thresholds (one model pass) agrees with the profile's thresholds
    t = calibrate_thresholds(lm.model, chunks, 0.3, score)
    np.testing.assert_allclose(t, prof.thresholds, rtol=2e-2)


def test_oracle_mask_changes_output_only_when_sparse(tiny_model_dir):
    lm = load_model(tiny_model_dir("swiglu"))
    x = torch.tensor([_chunks(lm.tokenizer, 64, 64)[0]])
    with torch.inference_mode():
        dense = lm.model(x, 0, lm.model.new_cache(1, 64))
        with oracle_sparsity(lm.model, [0.0] * lm.config.n_layers, "output"):
            same = lm.model(x, 0, lm.model.new_cache(1, 64))
        with oracle_sparsity(lm.model, [1e9] * lm.config.n_layers, "output"):
            empty = lm.model(x, 0, lm.model.new_cache(1, 64))
        after = lm.model(x, 0, lm.model.new_cache(1, 64))
    torch.testing.assert_close(same, dense)
    assert not torch.allclose(empty, dense)
    torch.testing.assert_close(after, dense)  # the hooks are gone


def test_histogram_quantile_matches_numpy():
    rng = np.random.default_rng(0)
    data = np.exp(rng.normal(-2, 3, size=(2, 200_000))).astype(np.float32)
    data[1, :1000] = 0.0  # exact zeros count as inactive
    h = ScoreHistogram(2)
    for l in range(2):
        for part in np.array_split(data[l], 7):
            h.add(l, torch.from_numpy(part))
    for d in (0.1, 0.5, 0.9):
        t = h.thresholds(d)
        for l in range(2):
            assert abs(float((data[l] > t[l]).mean()) - d) < 1e-3
            assert t[l] == pytest.approx(np.quantile(data[l], 1 - d), rel=1e-2)


def test_corpus_too_small(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir("reglu"))
    with pytest.raises(SparseInferError, match="corpus too small.*at least 256 tokens"):
        corpus_chunks(lm.tokenizer, ["Emma."], 128, 4096)
    with pytest.raises(SparseInferError, match="corpus file not found"):
        read_corpus([tmp_path / "missing.txt"])
    with pytest.raises(SparseInferError, match="expected a directory written by"):
        load_profile(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    with pytest.raises(SparseInferError, match="expected profile.json"):
        load_profile(tmp_path / "half")
