"""``sparseinfer convert`` on the architectures beyond llama: a GGUF written by llama.cpp's own
converter (Qwen2, Qwen3, Gemma 2, Gemma 3, Falcon, Phi-3; tiny random models) is profiled, given
predictors and exported; the sparse file loads back, and with every neuron active its logits
equal the source's (the exactness test), for each FFN kind (SwiGLU, GeGLU-tanh, Falcon's GELU
MLP, Phi-3's gate and up stored as one tensor)."""

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


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "falcon", "phi3_nowindow"])
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



def test_phi3_fused_gate_up_in_every_row_dtype(arch_model_dir, llamacpp_convert, tmp_path):
    """Phi-3's one gate+up tensor becomes gate and up rows per neuron in each row storage:
    float32 exact, bf16 and int8 rows within their rounding (measured 4e-3 and 1.3e-2). (4-bit
    rows move a tiny random model's logits by ~20% for every architecture, Qwen2's included, so
    they say nothing about the split here.)"""
    from sparseinfer.cli import main
    from sparseinfer.models.build import load

    src = llamacpp_convert(arch_model_dir("phi3_nowindow"))
    out = tmp_path / "phi3.sparse.gguf"
    assert main(["convert", "-m", str(src), "-o", str(out), *FAST]) == 0
    want = _logits(load(src, "fp32").model)
    for ffn_dtype, tol in (("fp32", 1e-4), ("bf16", 2e-2), ("int8", 5e-2)):
        got = _logits(load(out, "fp32", threshold=-float("inf"), ffn_dtype=ffn_dtype).model)
        assert float((got - want).abs().max() / want.abs().max()) < tol, ffn_dtype
