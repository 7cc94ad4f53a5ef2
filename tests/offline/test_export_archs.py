"""``sparseinfer convert`` on the architectures beyond llama: a GGUF written by llama.cpp's own
converter (Qwen2, Qwen3, Gemma 2, Gemma 3, Falcon; tiny random models) is profiled, given
predictors and exported; the sparse file loads back, and with every neuron active its logits
equal the source's (the exactness test), for each FFN kind (SwiGLU, GeGLU-tanh, Falcon's GELU
MLP). Phi-3 (gate and up in one tensor) is refused with one clear error."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

FAST = ["--max-tokens", "512", "--chunk-len", "64", "--ranks", "4", "--epochs", "2", "-t", "1",
        "--eval-chunks", "0", "--no-report"]
IDS = [1, 5, 9, 2, 7, 3, 11, 4, 6, 8]


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(torch.tensor([ids]), 0, model.new_cache(1, len(ids)))[0]


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "falcon"])
def test_convert_export_exact_with_all_neurons(arch_model_dir, llamacpp_convert, tmp_path, name):
    from sparseinfer.cli import main
    from sparseinfer.models.build import load

    src = llamacpp_convert(arch_model_dir(name))
    out = tmp_path / f"{name}.sparse.gguf"
    assert main(["convert", "-m", str(src), "-o", str(out), *FAST]) == 0
    want = _logits(load(src, "fp32").model)
    sparse = load(out, "fp32", threshold=-float("inf"))
    assert sparse.plan.sparse is not None and sparse.model.cfg.arch == load(src, "fp32").model.cfg.arch
    got = _logits(sparse.model)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    dense = load(out, "fp32", dense=True)
    torch.testing.assert_close(_logits(dense.model), want, rtol=1e-5, atol=1e-5)


def test_phi3_is_refused_with_one_clear_error(arch_model_dir, llamacpp_convert, tmp_path, capsys):
    from sparseinfer.cli import main

    src = llamacpp_convert(arch_model_dir("phi3_nowindow"))
    assert main(["convert", "-m", str(src), "-o", str(tmp_path / "p.gguf"), *FAST]) == 1
    err = capsys.readouterr().err
    assert "Phi-3 stores gate and up as one tensor" in err and "Traceback" not in err
