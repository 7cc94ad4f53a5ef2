"""4-bit blocks and the quantized projections (``--dtype q4``), against gguf-py's own
quantization code and plain float matmuls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from sparseinfer.quant import blocks as qb
from sparseinfer.quant.linear import (Int4Linear, Int8Linear, gemv_int8, gemv_int8_ref,
                                      reference)

BF16_REL = 2.0 ** -8  # relative rounding of a bfloat16 scale


def _gguf_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    return quants.quantize(w, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(8, 32), (5, 96), (64, 576)])
def test_from_gguf_equals_gguf_py_dequantize(kind, shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 0.05 + rng.uniform(-0.02, 0.02, (shape[0], 1))).astype(
        np.float32)
    raw = _gguf_blocks(w, kind)
    b = qb.from_gguf(raw, kind, shape)
    assert b.q.dtype == torch.uint8 and int(b.q.max()) <= 15
    want = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(shape)
    np.testing.assert_array_equal(b.dequantize().numpy(), want)


def test_from_gguf_rejects_wrong_sizes():
    raw = _gguf_blocks(np.zeros((4, 64), np.float32), "Q4_1")
    with pytest.raises(ValueError, match="expected 60 bytes, found 160"):
        qb.from_gguf(raw, "Q4_1", (3, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        qb.from_gguf(raw, "Q4_1", (4, 40))
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q4_K"):
        qb.from_gguf(raw, "Q8_0", (4, 64))


@pytest.mark.parametrize("shape", [(4, 256), (3, 768)])
def test_q4_k_blocks_equal_gguf_py_dequantize(shape):
    """Q4_K super-blocks map exactly onto 32-weight blocks (scale d·sc, offset -dmin·m)."""
    rng = np.random.default_rng(shape[1])
    n, k = shape
    raw = rng.integers(0, 256, (n, k // 256 * 144), dtype=np.uint8)
    sb = raw.reshape(n, -1, 144)
    sb[..., 0:2] = np.array([0.013], np.float16).view(np.uint8)  # sane fp16 d and dmin
    sb[..., 2:4] = np.array([0.021], np.float16).view(np.uint8)
    want = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(shape)
    np.testing.assert_array_equal(qb.from_gguf(raw, "Q4_K", shape).dequantize().numpy(), want)


def test_quantize_follows_q4_1_rule():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    b = qb.quantize(w)
    err = (b.dequantize() - w).abs().view(16, 4, 32)
    assert bool((err <= b.scale[..., None] / 2 + 1e-6).all())  # round to nearest level
    # weights that are already on a Q4_1 grid come back exactly (up to float rounding)
    grid = b.dequantize()
    assert torch.allclose(qb.quantize(grid).dequantize(), grid, atol=1e-6)
    # a constant block has scale 0 and is exact
    c = qb.quantize(torch.full((1, 32), 0.25))
    assert float(c.scale) == 0.0 and torch.equal(c.dequantize(), torch.full((1, 32), 0.25))


@pytest.mark.parametrize("n,k", [(32, 64), (96, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 7])
def test_int4_linear_matches_float_reference(n, k, m):
    torch.manual_seed(n + k + m)
    b = qb.quantize(torch.randn(n, k) * 0.05)
    bias = torch.randn(n)
    lin = Int4Linear.from_blocks(b, bias)
    # the weights it multiplies by are the blocks' up to bfloat16 scales
    deq = lin.dequantized()
    assert torch.allclose(deq, b.dequantize(), rtol=0,
                          atol=float(b.scale.abs().max() + b.offset.abs().max()) * 16 * BF16_REL)
    x = torch.randn(2, m, k)
    y = lin(x)
    assert y.shape == (2, m, n) and y.dtype == torch.float32
    ref = reference(lin, x)
    scale = float(ref.abs().max())
    assert float((y - ref).abs().max()) <= 0.02 * scale
    # and the plain float computation (fp32 activations, unrounded scales) is close too
    plain = torch.nn.functional.linear(x, b.dequantize(), bias)
    assert float((y - plain).abs().max()) <= 0.03 * scale


@pytest.mark.parametrize("n,k", [(1, 8), (7, 64), (1000, 576), (4099, 100)])
def test_gemv_int8_matches_reference(n, k):
    torch.manual_seed(n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, x = torch.rand(n) * 0.01, torch.randn(k)
    got = gemv_int8(q, scale, x, torch.empty(n))
    torch.testing.assert_close(got, gemv_int8_ref(q, scale, x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="expected contiguous float32"):
        gemv_int8(q, scale, x[:-1], torch.empty(n))


def test_int8_linear_matches_float_reference():
    torch.manual_seed(1)
    w = torch.randn(1000, 64)
    lin = Int8Linear.from_float(w)
    assert float((lin.dequantized() - w).abs().max()) <= float(w.abs().max()) / 127
    x = torch.randn(3, 64)
    y, ref = lin(x), reference(lin, x)
    assert float((y - ref).abs().max()) <= 0.02 * float(ref.abs().max())
    assert float((y - x @ w.T).abs().max()) <= 0.05 * float(ref.abs().max())
    # one token: the fp32 GEMV kernel, float32 scales
    one = lin(x[1])
    torch.testing.assert_close(one, gemv_int8_ref(lin.q, lin.scale32, x[1]), rtol=1e-4, atol=1e-4)
    assert float((one - x[1] @ w.T).abs().max()) <= 0.02 * float(one.abs().max())


@pytest.mark.slow
def test_smollm2_q4_keeps_the_files_blocks(smollm2):
    """--dtype q4 on the Q4_1 file: every projection is the file's own 4-bit blocks in torch's
    int4 layout (fused, un-permuted), multiplying by the fp32 model's weights (gguf-py
    dequantization) up to bfloat16 scales; perplexity within 1% of fp32 on real text."""
    from sparseinfer.models.build import load

    q4 = load(smollm2.path, "q4", max_seq_len=2048)
    storages = {(w.storage, w.origin) for w in q4.plan.weights if w.module.startswith("layers.")}
    assert storages == {("q4", "file blocks")}
    assert q4.plan.weight("lm_head").storage == "int8"
    for i in (0, smollm2.config.n_layers - 1):
        ref_blk, q_blk = smollm2.model.layers[i], q4.model.layers[i]
        for ref_lin, q_lin in ((ref_blk.attn.wqkv, q_blk.attn.wqkv), (ref_blk.attn.wo, q_blk.attn.wo),
                               (ref_blk.ffn.w_in, q_blk.ffn.w_in), (ref_blk.ffn.down, q_blk.ffn.down)):
            assert isinstance(q_lin, Int4Linear)
            w = ref_lin.weight
            err = (q_lin.dequantized() - w).abs().max()
            assert float(err) <= 4 * BF16_REL * float(w.abs().max()), (i, float(err))
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.perplexity import perplexity

    ids = smollm2.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:6000])
    p32 = perplexity(smollm2.model, ids, 256, None, 3).ppl
    p4 = perplexity(q4.model, ids, 256, None, 3).ppl
    assert abs(p4 / p32 - 1) < 0.01, (p32, p4)


@pytest.mark.slow
def test_smollm2_auto_runs_the_files_blocks_in_place(smollm2):
    """--dtype auto: the C kernels read the file's own Q4_1 / Q8_0 blocks (views of the map);
    each fused module multiplies by exactly the fp32 model's weights, and perplexity stays
    within 1% of fp32 (the input rounded to int8 blocks is the only approximation)."""
    from sparseinfer.models.build import load
    from sparseinfer.quant.linear import GGMLLinear

    lm = load(smollm2.path, "auto", max_seq_len=2048)
    assert {w.storage for w in lm.plan.weights if w.module != "tok_emb"} == {"ggml"}
    for i in (0, smollm2.config.n_layers - 1):
        for name in ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.down"):
            owner, attr = name.split(".")
            ours = getattr(getattr(lm.model.layers[i], owner), attr)
            ref = getattr(getattr(smollm2.model.layers[i], owner), attr)
            assert isinstance(ours, GGMLLinear)
            torch.testing.assert_close(ours.dequantized(), ref.weight, rtol=0, atol=0)
    from sparseinfer.data import HELDOUT_TEXT
    from sparseinfer.perplexity import perplexity

    # 12 chunks, not 3: rounding each layer's input to int8 turns a last-bit difference in a
    # sum into a different int8 code, so a short text's perplexity moves by about 1% with the
    # summation order alone (the avx2 and avx2_128 kernels, whose products agree to 1e-6
    # relative, gave +0.7% and +1.6% on 3 chunks, +0.4% and +0.6% on 12)
    ids = smollm2.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:26400])
    p32 = perplexity(smollm2.model, ids, 256, None, 12).ppl
    pq = perplexity(lm.model, ids, 256, None, 12).ppl
    assert abs(pq / p32 - 1) < 0.01, (p32, pq)


def test_requantized_tiny_model_equals_its_dequantized_weights(tiny_model_dir):
    """A float model (HF safetensors) under --dtype q4 is quantized here; its logits equal those
    of the fp32 model whose weights are replaced by the dequantized blocks."""
    from sparseinfer.models.build import load

    path = tiny_model_dir("swiglu")
    assert load(path, "auto").plan.label == "fp32"  # auto never quantizes a float file
    lm = load(path, "q4")
    assert {w.origin for w in lm.plan.weights if w.storage == "q4"} == {"requantized"}
    ref = load(path, "fp32").model
    for blk_ref, blk in zip(ref.layers, lm.model.layers):
        for name in ("attn.wqkv", "attn.wo", "ffn.w_in", "ffn.down"):
            owner, attr = name.split(".")
            q_lin = getattr(getattr(blk, owner), attr)
            getattr(getattr(blk_ref, owner), attr).weight.copy_(q_lin.dequantized())
    ref.lm_head.weight = torch.nn.Parameter(lm.model.lm_head.dequantized(), requires_grad=False)
    tokens = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    want = ref(tokens, 0, ref.new_cache(1, 16))
    got = lm.model(tokens, 0, lm.model.new_cache(1, 16))
    assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())


def test_engine_dtype_auto_and_errors(tiny_model_dir):
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, TokenEvent
    from sparseinfer.errors import SparseInferError

    dense = Engine.load(tiny_model_dir("opt"))
    assert dense.dtype == "fp32"
    e = Engine.load(tiny_model_dir("opt"), dtype="q4")  # biased projections, LayerNorm
    assert e.dtype == "q4" and isinstance(e.model.layers[0].attn.wqkv, Int4Linear)
    tokens = torch.tensor([e.encode("Emma said")])
    want = dense.model(tokens, 0, dense.model.new_cache(1, 16))
    got = e.model(tokens, 0, e.model.new_cache(1, 16))
    # 4-bit random weights: close, not equal (exactness is the swiglu test above)
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0)) > 0.95
    events = list(e.stream(tokens[0].tolist(), SamplingParams(max_tokens=4, temperature=0,
                                                              ignore_eos=True)))
    assert sum(isinstance(ev, TokenEvent) for ev in events) == 4
    with pytest.raises(SparseInferError, match="expected one of"):
        Engine.load(tiny_model_dir("opt"), dtype="int3")


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemm_int8_rows_matches_reference_and_is_batch_independent(rows):
    from sparseinfer.quant.linear import gemm_int8_rows

    gen = torch.Generator().manual_seed(rows)
    lin = Int8Linear.from_float(torch.randn(77, 64, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    got = lin.forward_rows(x)
    want = torch.stack([gemv_int8_ref(lin.q, lin.scale32, r) for r in x])
    assert torch.allclose(got, want, atol=1e-4)
    for i in range(rows):  # a row alone gives exactly what it gave in the batch
        assert torch.equal(gemm_int8_rows(lin.q, lin.scale32, x[i:i + 1])[0], got[i])
    with pytest.raises(ValueError, match="x"):
        gemm_int8_rows(lin.q, lin.scale32, torch.randn(2, 63))
