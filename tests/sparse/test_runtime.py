"""Exactness of the sparse runtime against the dense model (issue: sparse hybrid runtime).

- oracle active set (the true non-zero neurons) on ReLU-family models == dense logits;
- all neurons active (predictor threshold -inf) on any model == dense logits;
- the two-tier path (CPU standing in for the fast device) == the one-tier path.
"""

from __future__ import annotations

import pytest
import torch

from sparseinfer.models.build import load
from sparseinfer.sparse import kernels
from sparseinfer.sparse.runtime import sparse_info

RELU_KINDS = ("reglu", "drelu", "opt")


def load_model(path, **options):
    """The model as the load plan builds it (fp32, torch path unless ``fused``)."""
    return load(path, "fp32", **options)


def load_sparse(path, **options):
    """(loaded sparse model, its SparseInfo) for a directory with predictors."""
    lm = load(path, "fp32", **options)
    return lm, sparse_info(lm.model, lm.plan)


def _decode_logits(lm, ids: list[int]) -> torch.Tensor:
    """Logits of each position computed token by token (the sparse decode path)."""
    cache = lm.model.new_cache(1, len(ids) + 1)
    out = []
    with torch.inference_mode():
        for t, tok in enumerate(ids):
            out.append(lm.model(torch.tensor([[tok]]), t, cache)[0, -1])
    return torch.stack(out)


def _prefill_logits(lm, ids: list[int]) -> torch.Tensor:
    cache = lm.model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), 0, cache)[0]


IDS = [5, 17, 42, 99, 123, 7, 250, 31, 64, 300, 12, 77]


def _close(a, b, tol=1e-4):
    return float((a - b).abs().max() / b.abs().max()) < tol


@pytest.mark.parametrize("kind", RELU_KINDS)
def test_oracle_relu_equals_dense(tiny_model_dir, with_predictors, kind):
    path = tiny_model_dir(kind)
    dense = _decode_logits(load_model(path), IDS)
    lm, info = load_sparse(with_predictors(path), mode="oracle")
    got = _decode_logits(lm, IDS)
    assert _close(got, dense)
    # the oracle really skipped neurons: ReLU zeros about half of them on random weights
    assert 0.05 < info.density() < 0.95


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "geglu_tanh", "reglu", "drelu", "opt"])
@pytest.mark.parametrize("ffn_dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                       pytest.param("int8", marks=pytest.mark.slow), "q4"])
def test_all_active_equals_dense(tiny_model_dir, with_predictors, kind, ffn_dtype):
    path = tiny_model_dir(kind)
    dense = _decode_logits(load_model(path), IDS)
    lm, info = load_sparse(with_predictors(path), threshold=-float("inf"), ffn_dtype=ffn_dtype)
    got = _decode_logits(lm, IDS)
    assert info.density() == 1.0
    # q4: 4-bit round-to-nearest blocks of a random tiny model's FFN (the kernel itself matches
    # its reference tightly: tests/cpu/test_sparse_q4.py)
    tol = {"fp32": 1e-4, "bf16": 3e-2, "int8": 3e-2, "q4": 3e-1}[ffn_dtype]
    assert _close(got, dense, tol)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])  # GeGLU-tanh + post-norms; q/k/v biases
@pytest.mark.parametrize("ffn_dtype", ["fp32", "int8"])
def test_all_active_equals_dense_new_archs(arch_model_dir, with_predictors, arch, ffn_dtype):
    path = arch_model_dir(arch)
    dense = _decode_logits(load_model(path), IDS)
    lm, info = load_sparse(with_predictors(path), threshold=-float("inf"), ffn_dtype=ffn_dtype)
    assert lm.config.ffn_kind == {"gemma3": "geglu_tanh", "qwen2": "swiglu"}[arch]
    got = _decode_logits(lm, IDS)
    assert info.density() == 1.0
    # int8 rows: rounding, which Gemma's six layers with post-norms amplify a little
    assert _close(got, dense, {"fp32": 1e-4, "int8": 1e-1}[ffn_dtype])


@pytest.mark.parametrize("kind", ["swiglu", "opt"])
def test_prefill_path_equals_dense(tiny_model_dir, with_predictors, kind):
    path = tiny_model_dir(kind)
    dense = _prefill_logits(load_model(path), IDS)
    lm, info = load_sparse(with_predictors(path))
    info.set_batch_mode("dense")  # every neuron (the default "auto": each token's own set)
    assert _close(_prefill_logits(lm, IDS), dense)


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
def test_two_tiers_equal_one_tier(tiny_model_dir, with_predictors, kind):
    """CPU stands in for the fast device: hot neurons through the device-generic torch path,
    cold ones through the CPU kernel, merged — same logits as one tier."""
    path = with_predictors(tiny_model_dir(kind))
    one, _ = load_sparse(path, split_tiers=False)
    two, info = load_sparse(path, split_tiers=True, device="cpu", vram_budget=None)
    # stored placement is ignored on a CPU-only run unless tiers are forced with a budget
    assert info.hot_counts == [0, 0]
    two, info = load_sparse(path, split_tiers=True, device="cpu", vram_budget=0.0003, min_split=32)
    assert any(0 < k < two.config.d_ff for k in info.hot_counts), info.hot_counts
    assert all(m.split for m, k in zip(info.modules, info.hot_counts) if k)
    assert _close(_decode_logits(two, IDS), _decode_logits(one, IDS), 1e-5)


def test_missing_predictor_is_a_clear_error(tiny_model_dir, with_predictors):
    from sparseinfer.errors import SparseInferError

    path = with_predictors(tiny_model_dir("reglu"), drop="blk.1.fc2.weight")
    with pytest.raises(SparseInferError, match=r"missing tensor .*'blk\.1\.fc2\.weight'"):
        load_sparse(path)


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
def test_masked_batch_equals_token_by_token(tiny_model_dir, with_predictors, kind):
    """Perplexity scores the sparse model in batches: each token must keep its own active set,
    exactly what token-by-token decoding computes."""
    path = tiny_model_dir(kind)
    lm, info = load_sparse(with_predictors(path, seed=3))
    step = _decode_logits(lm, IDS)
    d_step = info.density()
    info.reset_stats()
    info.set_batch_mode("masked")
    batch = _prefill_logits(lm, IDS)
    assert _close(batch, step, 1e-5)
    assert abs(info.density() - d_step) < 1e-9 and 0.0 < d_step < 1.0
    info.set_batch_mode("dense")
    assert not _close(_prefill_logits(lm, IDS), step, 1e-5)  # random predictors drop neurons
    dense = _prefill_logits(lm, IDS)
    # the default: fp32 rows on numba's kernel, 12 tokens <= UNION_MAX_TOKENS: each token its
    # own set over the union's bundles, as "masked"
    info.set_batch_mode("auto")
    assert _close(_prefill_logits(lm, IDS), step, 1e-5)
    info.set_batch_mode("union")  # every token the union of the sets: more neurons than its own
    union = _prefill_logits(lm, IDS)
    assert not _close(union, step, 1e-5) and not _close(union, dense, 1e-5)


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
@pytest.mark.parametrize("ffn_dtype", ["int8", "q4"])
@pytest.mark.parametrize("n", [len(IDS), 40])
def test_masked_batch_in_c_equals_token_by_token(tiny_model_dir, with_predictors, kind,
                                                 ffn_dtype, n):
    """Rows the C kernels take: a masked batch (a continuous-batching step's few tokens, or a
    perplexity chunk longer than ``ffn.UNION_MAX_TOKENS``) reads the union's bundles once and
    gives each token its own set, as decoding it alone; a union batch gives each token more
    neurons, so other logits."""
    ids = (IDS * 4)[:n]
    lm, info = load_sparse(with_predictors(tiny_model_dir(kind), seed=3), ffn_dtype=ffn_dtype)
    assert info.ffn_dtype == ffn_dtype
    step = _decode_logits(lm, ids)
    d_step = info.density()
    info.reset_stats()
    info.set_batch_mode("masked")
    calls = []
    real = kernels.sparse_ffn_batch
    with pytest.MonkeyPatch.context() as mp:  # through the C kernel with a mask, not torch
        mp.setattr(kernels, "sparse_ffn_batch", lambda *a: calls.append(a[4]) or real(*a))
        batch = _prefill_logits(lm, ids)
    assert calls and all(m is not None and m.shape[0] == len(ids) for m in calls)
    assert _close(batch, step, 1e-5)
    assert abs(info.density() - d_step) < 1e-9 and 0.0 < d_step < 1.0
    info.set_batch_mode("union")
    assert not _close(_prefill_logits(lm, ids), step, 1e-5)


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
@pytest.mark.parametrize("kv_type,kernel", [("fp32", False), ("fp32", True), ("fp16", True)])
def test_batched_decode_rows_keep_their_own_sets(tiny_model_dir, with_predictors, kind, kv_type,
                                                 kernel):
    """A continuous-batching step ("auto") gives each sequence the neurons it would get decoded
    alone (its own predicted set, through the C kernel's mask), so the same logits whatever
    else is in the batch; with the per-row attention kernel (numba's on a float32 cache, the C
    library's on a float16 one, as the server runs it) too."""
    from sparseinfer.fused.decode import attend_rows
    from sparseinfer.models.batch import decode_step, slot_cache

    lm, info = load_sparse(with_predictors(tiny_model_dir(kind), seed=3), ffn_dtype="int8",
                           kv_type=kv_type)
    assert lm.model.kv_dtype == (torch.float16 if kv_type == "fp16" else torch.float32)
    seqs = [IDS[:4], IDS[3:9], IDS[6:9]]
    alone = [_decode_logits(lm, s)[-1] for s in seqs]
    cache = lm.model.new_cache(len(seqs), 16)
    with torch.inference_mode():
        for j, s in enumerate(seqs):
            for t, tok in enumerate(s[:-1]):
                lm.model(torch.tensor([[tok]]), t, slot_cache(cache, j))
        calls = []
        real = kernels.sparse_ffn_batch
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "sparse_ffn_batch", lambda *a: calls.append(a[4]) or real(*a))
            got = decode_step(lm.model, torch.tensor([s[-1] for s in seqs]),
                              torch.tensor([len(s) - 1 for s in seqs]), cache,
                              torch.arange(len(seqs)), attend_rows if kernel else None)
    assert calls and all(m is not None for m in calls)
    # float16 keys and values: the rows' projections (a torch GEMM here) differ from a lone
    # token's GEMV in the last float32 bit, which can move a value to the next float16
    tol = 1e-4 if kv_type == "fp16" else 1e-5
    for j in range(len(seqs)):
        assert _close(got[j], alone[j], tol)


@pytest.mark.parametrize("kind", RELU_KINDS)
def test_union_prefill_oracle_relu_equals_dense(tiny_model_dir, with_predictors, kind):
    """Batched-sparse prefill over the union of the tokens' true active sets is exact on
    ReLU-family models (every neuron outside the union is zero for every token)."""
    path = tiny_model_dir(kind)
    dense = _prefill_logits(load_model(path), IDS)
    lm, info = load_sparse(with_predictors(path), mode="oracle")
    info.set_batch_mode("union")
    assert _close(_prefill_logits(lm, IDS), dense)
    assert 0.0 < info.density() <= 1.0


def test_union_prefill_computes_the_union_of_predicted_sets(tiny_model_dir, with_predictors):
    """With predictors, each token gets exactly the union's neurons: the same as a masked batch
    whose every mask is the union (the torch reference path)."""
    from sparseinfer.sparse.reference import sparse_ffn_ref

    lm, info = load_sparse(with_predictors(tiny_model_dir("swiglu"), seed=5))
    ffn = info.modules[0]
    x = torch.randn(1, 6, lm.config.d_model)
    ffn.batch_mode = "union"
    got = ffn(x)[0]
    union = ffn.selector.mask(ffn, x[0]).any(0)
    idx = torch.nonzero(union).reshape(-1)
    assert 0 < idx.numel() < lm.config.d_ff
    for t in range(6):
        want = sparse_ffn_ref(x[0, t], ffn.packed, idx, torch.empty(lm.config.d_model))
        assert _close(got[t], want, 1e-5)
    with pytest.raises(ValueError, match="batch mode"):
        info.set_batch_mode("sideways")


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "opt"])
def test_fused_decode_equals_torch_decode(tiny_model_dir, kind):
    """The numba GEMV of FloatLinear (one token) and the fused block decode (RMSNorm/RoPE
    models) change no output."""
    path = tiny_model_dir(kind)
    ref = _decode_logits(load_model(path), IDS)
    lm = load_model(path, fused=True)
    assert _close(_decode_logits(lm, IDS), ref, 1e-5)
    assert _close(_prefill_logits(lm, IDS), _prefill_logits(load_model(path), IDS), 1e-5)


def test_gemv_matches_torch_mv():
    from sparseinfer.sparse.kernels import gemv

    g = torch.Generator().manual_seed(0)
    for n, d in [(1, 5), (7, 13), (49152 // 64, 576), (130, 64)]:
        w, x = torch.randn(n, d, generator=g), torch.randn(d, generator=g)
        assert torch.allclose(gemv(w, x, torch.empty(n)), torch.mv(w, x), rtol=1e-5, atol=1e-5)


def test_bf16_rows_take_bf16_predictors(tiny_model_dir, with_predictors):
    """--ffn-dtype bf16 also halves the predictors (bf16); their kernel selects what the torch
    reference selects, and the model still decodes with it."""
    from sparseinfer.sparse.reference import predict_active_ref

    lm, info = load_sparse(with_predictors(tiny_model_dir("reglu"), seed=7), ffn_dtype="bf16")
    ffn = info.modules[0]
    assert ffn.predictor.fc1.dtype == torch.bfloat16 == ffn.predictor.fc2.dtype
    x = torch.randn(lm.config.d_model)
    want = torch.empty(lm.config.d_ff, dtype=torch.int32)
    k = predict_active_ref(x, ffn.predictor.fc1, ffn.predictor.fc2, ffn.predictor.threshold, want,
                           neuron_thresholds=ffn.selector._neuron_thr)
    assert torch.equal(ffn.active(x), want[:k])
    logits = _decode_logits(lm, IDS)
    assert torch.isfinite(logits).all() and 0.0 < info.density() < 1.0


def test_int8_rows_blocks_and_predictors(tiny_model_dir, with_predictors):
    """--ffn-dtype int8: rows with a float32 scale per 32 weights and float16 predictors, both on
    the C library (as q4 rows); the predictor selects what the torch reference selects on the
    same float16 values (but for neurons within float32 rounding of their threshold), and the
    model still decodes."""
    from sparseinfer.sparse.reference import predict_active_ref

    lm, info = load_sparse(with_predictors(tiny_model_dir("reglu"), seed=7), ffn_dtype="int8")
    ffn = info.modules[0]
    d, f = lm.config.d_model, lm.config.d_ff
    assert d % 32 == 0 and ffn.packed.block == 32
    assert tuple(ffn.packed.scales.shape) == (f, 3, d // 32)
    p = ffn.predictor
    assert p.fc1.dtype == torch.float16 == p.fc2.dtype and ffn.selector._c is not None
    x = torch.randn(d)
    want = torch.empty(f, dtype=torch.int32)
    k = predict_active_ref(x, p.fc1.float(), p.fc2.float(), p.threshold, want,
                           neuron_thresholds=ffn.selector._neuron_thr)
    got = set(ffn.active(x).tolist())
    logits = p.fc2.double() @ torch.relu(p.fc1.double() @ x.double())
    thr = ffn.selector._neuron_thr
    thr = torch.full((f,), p.threshold) if thr is None else thr
    margin = (logits - thr.double()).abs()
    assert all(margin[i] <= 1e-5 * (1 + logits.abs().max()) for i in got ^ set(want[:k].tolist()))
    logits = _decode_logits(lm, IDS)
    assert torch.isfinite(logits).all() and 0.0 < info.density() < 1.0


def test_auto_prefill_of_long_prompts_over_fp32_rows(tiny_model_dir, with_predictors):
    """Past UNION_MAX_TOKENS, "auto" prefills densely over fp32 rows (no C kernel for them)."""
    from sparseinfer.sparse.ffn import UNION_MAX_TOKENS

    lm, info = load_sparse(with_predictors(tiny_model_dir("reglu"), seed=9), ffn_dtype="fp32")
    ids = (IDS * 4)[: UNION_MAX_TOKENS + 8]
    auto = _prefill_logits(lm, ids)
    info.set_batch_mode("dense")
    assert torch.equal(_prefill_logits(lm, ids), auto)


@pytest.mark.parametrize("ffn_dtype", ["int8", "q4"])
def test_auto_prefill_gives_each_prompt_token_its_own_set(tiny_model_dir, with_predictors,
                                                          ffn_dtype):
    """Rows the C kernels take: "auto" prefills a prompt, short or past UNION_MAX_TOKENS, with
    each token's own set through the kernel's mask, so each position's logits are those of
    the prompt decoded token by token, at the decode's density."""
    from sparseinfer.sparse.ffn import UNION_MAX_TOKENS

    lm, info = load_sparse(with_predictors(tiny_model_dir("reglu"), seed=9), ffn_dtype=ffn_dtype)
    for ids in (IDS, (IDS * 4)[: UNION_MAX_TOKENS + 8]):
        info.reset_stats()
        step = _decode_logits(lm, ids)
        d_step = info.density()
        info.reset_stats()
        calls = []
        real = kernels.sparse_ffn_batch
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "sparse_ffn_batch", lambda *a: calls.append(a[4]) or real(*a))
            got = _prefill_logits(lm, ids)
        assert calls and all(m is not None and m.shape[0] == len(ids) for m in calls)
        assert _close(got, step, 1e-5)
        assert abs(info.density() - d_step) < 1e-9 and 0.0 < d_step < 1.0


@pytest.mark.parametrize("arch,fused", [("qwen2", True), ("llama3", True), ("gemma3", True),
                                        ("gemma2", True), ("falcon", False)])
def test_fused_decode_new_archs(arch_model_dir, arch, fused):
    """The fused block decode takes q/k/v biases and scaled rope tables as they are, Gemma 3's
    q/k norms, windows and post-norms and Gemma 2's soft-capped scores on the C block; blocks it
    does not implement (Falcon's LayerNorm and parallel attention) keep the torch path."""
    path = arch_model_dir(arch)
    ref = _decode_logits(load_model(path), IDS)
    lm = load_model(path, fused=True)
    assert (lm.model.layers[0].fused is not None) == fused
    assert _close(_decode_logits(lm, IDS), ref, 1e-5)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])  # post-norms, windows; q/k norms
@pytest.mark.parametrize("ffn_dtype", ["int8", "q4"])
def test_sparse_blocks_beyond_llama_on_the_c_block(arch_model_dir, with_predictors, arch,
                                                    ffn_dtype):
    """Blocks that are not plain llama blocks (Gemma 3, Qwen3) fuse only whole on the C block;
    with a sparse FFN the C block takes (float16 predictors over int8 or q4 rows, or every
    neuron) they now do, every layer one C call: with every neuron the logits of the torch path
    (the same rows; norms and attention rounded otherwise); with the predictors its share of
    neurons and logits (a logit within rounding of a threshold may select otherwise: loosely).
    Oracle sets keep the torch path."""
    from sparseinfer.fused.decode import FusedStack

    path = with_predictors(arch_model_dir(arch), seed=2)
    for threshold, tol in ((-float("inf"), 1e-4), (None, 5e-2)):
        kw = {} if threshold is None else {"threshold": threshold}
        lm, info = load_sparse(path, ffn_dtype=ffn_dtype, fused=True, **kw)
        assert lm.plan.fused_decode and isinstance(lm.model._fused_stack(), FusedStack)
        got = _decode_logits(lm, IDS)
        ref, ref_info = load_sparse(path, ffn_dtype=ffn_dtype, **kw)
        assert not ref.plan.fused_decode
        assert _close(got, _decode_logits(ref, IDS), tol)
        if threshold is None:
            assert 0.0 < info.density() < 1.0
            assert abs(info.density() - ref_info.density()) < 1e-2
        else:
            assert info.density() == ref_info.density() == 1.0
    oracle, _ = load_sparse(path, ffn_dtype=ffn_dtype, fused=True, mode="oracle")
    assert not oracle.plan.fused_decode


@pytest.mark.parametrize("kind", ["reglu", "swiglu"])
@pytest.mark.parametrize("ffn_dtype", ["int8", "q4"])
def test_sparse_blocks_in_one_c_call(tiny_model_dir, with_predictors, kind, ffn_dtype):
    """A fused model whose sparse FFNs the C block takes (float16 predictors, rows of the C
    kernels) runs each decode step as one C call (``FusedStack``), the predictor and the rows
    inside each block: the logits and the neurons counted are the blocks' per-layer path's (the
    same kernels around the ``SparseFFN`` modules; norms and attention rounded otherwise); a
    prompt goes through it as rows (each token its own set) and a batched step too."""
    from sparseinfer.fused.decode import FusedStack
    from sparseinfer.models.batch import decode_step, slot_cache
    from sparseinfer.sparse.ffn import SparseFFN

    path = with_predictors(tiny_model_dir(kind), seed=3)
    lm, info = load_sparse(path, ffn_dtype=ffn_dtype, fused=True)
    stack = lm.model._fused_stack()
    assert isinstance(stack, FusedStack) and not lm.model.rows_exact()
    got = _decode_logits(lm, IDS)
    density = info.density()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SparseFFN, "c_block_ffn", lambda self: None)
        lm2, info2 = load_sparse(path, ffn_dtype=ffn_dtype, fused=True)
        assert lm2.model._fused_stack() is None
        want = _decode_logits(lm2, IDS)
    assert _close(got, want, 1e-5)
    assert density == info2.density() and 0.0 < density < 1.0
    info.reset_stats()
    prompt = _prefill_logits(lm, IDS)
    assert _close(prompt, got, 1e-5) and abs(info.density() - density) < 1e-9
    info.set_batch_mode("union")  # read by the C blocks at each call
    assert not _close(_prefill_logits(lm, IDS), got, 1e-5) and info.density() > density
    info.set_batch_mode("auto")
    seqs = [IDS[:4], IDS[3:9], IDS[6:9]]
    cache = lm.model.new_cache(len(seqs), 16)
    with torch.inference_mode():
        for j, s in enumerate(seqs):
            lm.model(torch.tensor([s[:-1]]), 0, slot_cache(cache, j))
        step = decode_step(lm.model, torch.tensor([s[-1] for s in seqs]),
                           torch.tensor([len(s) - 1 for s in seqs]), cache,
                           torch.arange(len(seqs)))
    for j, s in enumerate(seqs):
        assert _close(step[j], _decode_logits(lm, s)[-1], 1e-5)
