"""Neuron-aware operators: numba kernels vs torch references vs an independent dense FFN."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels, reference
from sparseinfer.sparse.packed import PackedFFN, empty_hugepages, expand_scales, quantize_int8

KINDS = sorted(FFN_KINDS)
SLOW = pytest.mark.slow  # the quick loop keeps small shapes, one seed, two densities
SHAPES = [(13, 37), (64, 100), pytest.param((576, 1536), marks=SLOW)]  # (d_model, d_ff): odd
# sizes, SmolLM2's FFN
# (dtype, block): block 0 = per row for int8; "blk" = a per-block size that fits the shape
DTYPES = [("fp32", 0), ("bf16", 0), ("int8", 0), ("int8", "blk")]
BLOCK_FOR = {13: 4, 64: 16, 576: 32}  # 13 = 3*4 + 1: a short last block
DENSITIES = [pytest.param(0.0, marks=SLOW), 0.05, pytest.param(0.5, marks=SLOW), 1.0]
SEEDS = [0, pytest.param(1, marks=SLOW)]

# Independent definition of each kind (not via FFN_KINDS / reference.ACTS).
DENSE_H = {
    "swiglu": lambda g, u: F.silu(g) * u,
    "geglu": lambda g, u: F.gelu(g) * u,
    "geglu_tanh": lambda g, u: F.gelu(g, approximate="tanh") * u,
    "reglu": lambda g, u: F.relu(g) * u,
    "drelu": lambda g, u: F.relu(g) * F.relu(u),
    "relu": lambda g, u: F.relu(u),
    "gelu": lambda g, u: F.gelu(u),
}


@functools.lru_cache(maxsize=None)
def dense_weights(kind: str, d: int, f: int, seed: int):
    """nn.Linear-layout fp32 weights: gate|None, up, down, up_bias|None."""
    g = torch.Generator().manual_seed(seed)
    gated = FFN_KINDS[kind].gated
    s = 1 / math.sqrt(d)
    gate = torch.randn(f, d, generator=g) * s if gated else None
    up = torch.randn(f, d, generator=g) * s
    down = torch.randn(d, f, generator=g) / math.sqrt(f)
    bias = None if gated else torch.randn(f, generator=g) * 0.5
    return gate, up, down, bias


@functools.lru_cache(maxsize=None)
def packed(kind: str, dtype: str, block, d: int, f: int, seed: int) -> PackedFFN:
    gate, up, down, bias = dense_weights(kind, d, f, seed)
    blk = BLOCK_FOR[d] if block == "blk" else block
    return PackedFFN.from_dense(kind, gate, up, down, bias, dtype=dtype, block=blk)


def active_set(f: int, density: float, seed: int, dtype=torch.int32) -> torch.Tensor:
    k = round(f * density)
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randperm(f, generator=g)[:k].to(dtype)  # unsorted on purpose


def inputs(d: int, seed: int, T: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(d if T is None else (T, d), generator=g)


_DEQUANT: dict[int, tuple] = {}


def dequantized(ffn: PackedFFN):
    """``ffn.dequantized()``, cached per (cached) test FFN."""
    if id(ffn) not in _DEQUANT:
        _DEQUANT[id(ffn)] = (ffn, *ffn.dequantized())  # keeps ffn alive, so the id stays unique
    return _DEQUANT[id(ffn)][1:]


def dense_masked(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor, absolute: bool = False):
    """The FFN by plain dense matmuls on the dequantized weights, h masked to the active set.

    ``absolute``: |h| @ |down| instead — the magnitude of the summed terms, for tolerances.
    """
    gate, up, down = dequantized(ffn)
    u = F.linear(x, up, ffn.up_bias)
    h = DENSE_H[ffn.kind](F.linear(x, gate) if gate is not None else None, u)
    mask = torch.zeros(ffn.d_ff)
    mask[idx.long()] = 1.0
    if absolute:
        return F.linear((h * mask).abs(), down.abs())
    return F.linear(h * mask, down)


def scale_of(x: torch.Tensor, ffn: PackedFFN, idx: torch.Tensor) -> float:
    return float(dense_masked(x, ffn, idx, absolute=True).max()) + 1e-6


# Kernel and reference use the same stored weights; they differ only by summation order
# (float32 either way), so one relative tolerance fits every storage dtype.
RTOL = {"fp32": 1e-5, "bf16": 1e-5, "int8": 1e-5}


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request, monkeypatch):
    before = kernels.get_threads()
    kernels.set_threads(request.param)
    if request.param > 1:  # small shapes would otherwise take the one-thread path
        monkeypatch.setattr(kernels, "SERIAL_BYTES", 0)
    yield request.param
    kernels.set_threads(before)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype,block", DTYPES, ids=["fp32", "bf16", "int8row", "int8blk"])
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_ffn_matches_reference(kind, dtype, block, shape, density, seed, threads):
    d, f = shape
    ffn = packed(kind, dtype, block, d, f, seed)
    x = inputs(d, seed)
    idx = active_set(f, density, seed)
    # (int8 rows in blocks of 32: the C kernel's gate/up products take x rounded to int8)
    xr = cpu_ref.rounded_x(x) if kernels.rounds_x(ffn) else x
    want = reference.sparse_ffn_ref(xr, ffn, idx, torch.empty(d))
    out = torch.full((d,), float("nan"))  # must be overwritten, not accumulated into
    got = kernels.sparse_ffn(x, ffn, idx, out)
    assert got is out
    if idx.numel() == 0:
        assert torch.equal(out, torch.zeros(d))
    tol = RTOL[dtype] * scale_of(x, ffn, idx)
    torch.testing.assert_close(out, want, rtol=RTOL[dtype], atol=tol)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype,block", DTYPES, ids=["fp32", "bf16", "int8row", "int8blk"])
@pytest.mark.parametrize("kind", KINDS)
def test_reference_matches_dense(kind, dtype, block, shape, density, seed):
    d, f = shape
    ffn = packed(kind, dtype, block, d, f, seed)
    x = inputs(d, seed)
    idx = active_set(f, density, seed, torch.int64)
    got = reference.sparse_ffn_ref(x, ffn, idx, torch.empty(d))
    want = dense_masked(x, ffn, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale_of(x, ffn, idx))


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantized_round_trip(kind, shape):
    d, f = shape
    gate, up, down, bias = dense_weights(kind, d, f, 0)
    for dtype, block in DTYPES:
        ffn = packed(kind, dtype, block, d, f, 0)
        g2, u2, d2 = ffn.dequantized()
        assert (g2 is None) == (gate is None)
        assert u2.shape == up.shape and d2.shape == down.shape
        if ffn.gated:
            assert g2.shape == gate.shape
        # stored rows are quantized along d_model: rows of up/gate, columns of down
        pairs = [(u2, up), (d2.t(), down.t())] + ([(g2, gate)] if gate is not None else [])
        for got, w in pairs:
            if dtype == "fp32":
                assert torch.equal(got, w)
            elif dtype == "bf16":
                assert torch.equal(got, w.to(torch.bfloat16).float())
            else:  # int8: within half a quantization step of each block's scale
                blk = BLOCK_FOR[d] if block == "blk" else d
                _, s = quantize_int8(w, blk)
                step = expand_scales(s, blk, w.shape[1])
                assert torch.all((got - w).abs() <= 0.5 * step + 1e-7)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [0, "blk"], ids=["row", "blk"])
def test_int8_error_is_small(kind, block):
    """int8 output vs the fp32 weights' output: a few per cent of its magnitude at most."""
    d, f = 576, 1536
    x = inputs(d, 0)
    idx = active_set(f, 0.5, 0)
    exact = reference.sparse_ffn_ref(x, packed(kind, "fp32", 0, d, f, 0), idx, torch.empty(d))
    q = kernels.sparse_ffn(x, packed(kind, "int8", block, d, f, 0), idx, torch.empty(d))
    rel = float((q - exact).norm() / exact.norm())
    assert rel < 0.03, f"int8 relative error: expected < 0.03, found {rel:.4f}"


def test_int8_blocks_beat_rows():
    d, f = 576, 1536
    gate, up, down, _ = dense_weights("swiglu", d, f, 0)
    err = {}
    for block in (0, 32):
        ffn = PackedFFN.from_dense("swiglu", gate, up, down, dtype="int8", block=block)
        _, u2, _ = ffn.dequantized()
        err[block] = float((u2 - up).norm())
    assert err[32] < err[0]


@pytest.mark.parametrize("dtype,block", DTYPES, ids=["fp32", "bf16", "int8row", "int8blk"])
def test_int64_and_int32_indices_agree(dtype, block):
    d, f = 64, 100
    ffn = packed("swiglu", dtype, block, d, f, 0)
    x = inputs(d, 0)
    idx = active_set(f, 0.3, 0)
    a = kernels.sparse_ffn(x, ffn, idx, torch.empty(d))
    b = kernels.sparse_ffn(x, ffn, idx.long(), torch.empty(d))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("dtype,block", DTYPES, ids=["fp32", "bf16", "int8row", "int8blk"])
@pytest.mark.parametrize("kind", ["swiglu", "drelu", "relu"])
def test_batch_matches_reference(kind, dtype, block, T, threads):
    d, f = 64, 100
    ffn = packed(kind, dtype, block, d, f, 0)
    x = inputs(d, 0, T)
    idx = active_set(f, 0.3, 0)
    want = reference.sparse_ffn_batch_ref(x, ffn, idx, torch.empty(T, d))
    for t in range(T):  # the batched reference is the per-token one, row by row
        row = reference.sparse_ffn_ref(x[t], ffn, idx, torch.empty(d))
        torch.testing.assert_close(want[t], row, rtol=1e-5, atol=1e-5)
    if kernels.rounds_x(ffn):  # what the C kernel's gate/up products take
        want = reference.sparse_ffn_batch_ref(cpu_ref.rounded_x(x), ffn, idx, torch.empty(T, d))
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, d), float("nan")))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,block,engine", [
    *[(dt, b, "numba") for dt, b in DTYPES],
    ("int8", 0, "c"), ("int8", "blk", "c"), ("q4", 0, "c")])
@pytest.mark.parametrize("kind", ["swiglu", "reglu", "relu"])
def test_masked_batch_is_each_tokens_own_set(kind, dtype, block, engine, threads, monkeypatch):
    """A mask over the union: each token's row is the reference over its own set alone (numba's
    kernel, or the C kernels where they take the rows), a group masked for every token and a
    masked place holding a repeated row add nothing."""
    d, f, T = 64, 100, 5
    ffn = packed(kind, dtype, block, d, f, 0)
    if engine == "numba":
        monkeypatch.setattr(kernels, "in_c", lambda ffn: False)
    elif not kernels.in_c(ffn):
        pytest.skip("the C library does not load here")
    x = inputs(d, 1, T)
    idx = torch.cat([active_set(f, 0.4, 0), torch.tensor([3], dtype=torch.int32)])
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(T, idx.numel(), generator=g) < 0.6
    mask[:, 4:8] = False  # a whole group of 4 for nobody
    mask[:, -1] = False  # the repeated row: for nobody
    mask[2] = False  # a token with no neuron
    got = kernels.sparse_ffn_batch(x, ffn, idx, torch.full((T, d), float("nan")), mask)
    xr = cpu_ref.rounded_x(x) if engine == "c" and kernels.rounds_x(ffn) else x
    for t in range(T):
        want = reference.sparse_ffn_ref(xr[t], ffn, idx[mask[t]], torch.empty(d))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
    assert not got[2].any()
    with pytest.raises(ValueError, match="mask: expected"):
        kernels.sparse_ffn_batch(x, ffn, idx, torch.empty(T, d), mask[:, 1:])


def test_select_is_a_sub_ffn():
    d, f = 64, 100
    for dtype, block in DTYPES:
        ffn = packed("relu", dtype, block, d, f, 0)
        hot = torch.tensor([5, 1, 77, 42, 0, 99])
        sub = ffn.select(hot)
        assert sub.d_ff == 6 and sub.rows.shape == (6, 2, d)
        x = inputs(d, 0)
        a = kernels.sparse_ffn(x, sub, torch.arange(6, dtype=torch.int32), torch.empty(d))
        b = kernels.sparse_ffn(x, ffn, hot.int(), torch.empty(d))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sub.nbytes < ffn.nbytes


def test_nbytes_and_layout():
    d, f = 64, 100
    fp = packed("swiglu", "fp32", 0, d, f, 0)
    assert fp.rows.shape == (f, 3, d) and fp.nbytes == f * 3 * d * 4
    assert packed("swiglu", "bf16", 0, d, f, 0).nbytes == f * 3 * d * 2
    q = packed("swiglu", "int8", "blk", d, f, 0)
    assert q.block == 16 and q.scales.shape == (f, 3, 4)
    assert q.nbytes == f * 3 * d + f * 3 * 4 * 4
    assert packed("swiglu", "int8", 0, d, f, 0).block == d
    r = packed("relu", "fp32", 0, d, f, 0)
    assert r.rows.shape == (f, 2, d) and r.nbytes == f * 2 * d * 4 + f * 4
    # one neuron is one contiguous bundle: gate row, up row, down column
    gate, up, down, _ = dense_weights("swiglu", d, f, 0)
    assert torch.equal(fp.rows[7].reshape(-1), torch.cat([gate[7], up[7], down[:, 7]]))


def test_errors_say_expected_and_found():
    d, f = 13, 37
    ffn = packed("swiglu", "fp32", 0, d, f, 0)
    idx = torch.arange(4, dtype=torch.int32)
    x = torch.zeros(d)
    with pytest.raises(ValueError, match=r"x: expected float32 \[13\], got torch.float32 \[12\]"):
        kernels.sparse_ffn(torch.zeros(12), ffn, idx, torch.empty(d))
    with pytest.raises(ValueError, match="out: expected"):
        kernels.sparse_ffn(torch.zeros(d), ffn, idx, torch.empty(d, dtype=torch.float64))
    with pytest.raises(ValueError, match="idx: expected"):
        kernels.sparse_ffn(torch.zeros(d), ffn, idx.float(), torch.empty(d))
    with pytest.raises(IndexError, match=r"\[0, 37\), found 37"):
        kernels.sparse_ffn(x, ffn, torch.tensor([1, 37], dtype=torch.int32), torch.empty(d))
    with pytest.raises(IndexError, match="found -1"):
        kernels.sparse_ffn(x, ffn, torch.tensor([-1], dtype=torch.int32), torch.empty(d))
    with pytest.raises(ValueError, match="kind: expected one of"):
        PackedFFN.from_dense("swish", None, torch.zeros(4, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="gate: expected None for ungated"):
        PackedFFN.from_dense("relu", torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"down: expected \[8, 4\], got \[4, 8\]"):
        PackedFFN.from_dense("swiglu", torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8))
    up, down = torch.zeros(4, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="block: expected"):
        PackedFFN.from_dense("relu", None, up, down, dtype="int8", block=9)
    with pytest.raises(ValueError, match="block: expected 0 for dtype 'fp32'"):
        PackedFFN.from_dense("relu", None, up, down, dtype="fp32", block=4)
    with pytest.raises(ValueError, match="threads: expected"):
        kernels.set_threads(0)


# --------------------------------------------------------------------------- predictor


def predictor(d: int, r: int, f: int, seed: int, integer: bool = False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: every logit is exact in float32, whatever the summation order
        fc1 = torch.randint(-3, 4, (r, d), generator=g).float()
        fc2 = torch.randint(-3, 4, (f, r), generator=g).float()
        x = torch.randint(-3, 4, (d,), generator=g).float()
    else:
        fc1 = torch.randn(r, d, generator=g) / math.sqrt(d)
        fc2 = torch.randn(f, r, generator=g) / math.sqrt(r)
        x = torch.randn(d, generator=g)
    return x, fc1, fc2


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(13, 5, 37), (64, 16, 100), (576, 64, 1536)])
@pytest.mark.parametrize("quantile", [0.0, 0.5, 0.95])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_predict_active_matches_reference(shape, quantile, seed, wdtype, threads):
    d, r, f = shape
    x, fc1, fc2 = predictor(d, r, f, seed)
    fc1, fc2 = fc1.to(wdtype), fc2.to(wdtype)
    logits = fc2.float() @ torch.relu(fc1.float() @ x)
    threshold = float(torch.quantile(logits, quantile)) - 1e-3  # away from any logit
    a = torch.full((f,), -7, dtype=torch.int32)
    b = torch.full((f,), -7, dtype=torch.int32)
    k_ref = reference.predict_active_ref(x, fc1, fc2, threshold, a)
    k = kernels.predict_active(x, fc1, fc2, threshold, b)
    assert k == k_ref
    assert torch.equal(a[:k], b[:k])
    assert torch.all(b[:k][1:] > b[:k][:-1])  # ascending


@pytest.mark.parametrize("shape", [(13, 5, 37), (64, 16, 100)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_predict_active_threshold_edges(shape, wdtype, threads):
    d, r, f = shape
    x, fc1, fc2 = predictor(d, r, f, 3, integer=True)  # small integers: exact in bf16 too
    logits = fc2 @ torch.relu(fc1 @ x)
    fc1, fc2 = fc1.to(wdtype), fc2.to(wdtype)
    out = torch.empty(f, dtype=torch.int32)
    ref = torch.empty(f, dtype=torch.int32)
    for threshold in [float(logits[5]), float(logits.max()), float("inf"), -float("inf"), 0.0]:
        k = kernels.predict_active(x, fc1, fc2, threshold, out)
        k_ref = reference.predict_active_ref(x, fc1, fc2, threshold, ref)
        want = torch.nonzero(logits >= threshold).reshape(-1)
        assert k == k_ref == want.numel(), threshold
        assert torch.equal(out[:k].long(), want) and torch.equal(ref[:k].long(), want)
    assert kernels.predict_active(x, fc1, fc2, float("inf"), out) == 0
    assert kernels.predict_active(x, fc1, fc2, -float("inf"), out) == f
    # logit == threshold counts as active
    assert 5 in out[: kernels.predict_active(x, fc1, fc2, float(logits[5]), out)].tolist()


def test_predict_errors():
    x, fc1, fc2 = predictor(13, 5, 37, 0)
    with pytest.raises(ValueError, match="out_idx: expected int32"):
        kernels.predict_active(x, fc1, fc2, 0.0, torch.empty(37, dtype=torch.int64))
    with pytest.raises(ValueError, match="fc1/fc2: expected"):
        fc2_t = fc2.t().contiguous()
        kernels.predict_active(x, fc1, fc2_t, 0.0, torch.empty(37, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected one dtype"):
        kernels.predict_active(x, fc1, fc2.bfloat16(), 0.0, torch.empty(37, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.predict_active(x, fc1.half(), fc2.half(), 0.0, torch.empty(37, dtype=torch.int32))


@pytest.mark.parametrize("kind", ["reglu", "relu"])
def test_predicted_ffn_is_predict_then_ffn(kind, threads):
    d, f = 64, 100
    ffn = packed(kind, "bf16", 0, d, f, 0)
    x, fc1, fc2 = predictor(d, 16, f, 0)
    idx = torch.empty(f, dtype=torch.int32)
    out = torch.empty(d)
    k = kernels.sparse_ffn_predicted(x, ffn, fc1, fc2, 0.0, idx, out)
    ref_idx = torch.empty(f, dtype=torch.int32)
    assert k == reference.predict_active_ref(x, fc1, fc2, 0.0, ref_idx)
    want = reference.sparse_ffn_ref(x, ffn, ref_idx[:k], torch.empty(d))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- dense baseline


@pytest.mark.parametrize("dtype,block", DTYPES, ids=["fp32", "bf16", "int8row", "int8blk"])
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_dense_baseline(kind, dtype, block):
    d, f = 64, 100
    ffn = packed(kind, dtype, block, d, f, 0)
    x = inputs(d, 0)
    want = dense_masked(x, ffn, torch.arange(f))
    ref = reference.dense_ffn_ref(x, ffn, torch.empty(d))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    got = kernels.dense_ffn_ref(x, ffn, torch.empty(d), weights="fp32")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if dtype == "int8" and block == "blk":
        with pytest.raises(ValueError, match="per-row scales"):
            kernels.dense_ffn_ref(x, ffn, torch.empty(d), weights="stored")
        return
    stored = kernels.dense_ffn_ref(x, ffn, torch.empty(d), weights="stored")
    # bf16 matmul rounds x and h to bf16; the int8 path requantizes down per row
    tol = {"fp32": 1e-5, "bf16": 3e-2, "int8": 3e-2}[dtype]
    assert float((stored - want).norm() / want.norm()) < tol


def test_empty_hugepages_is_aligned_and_usable():
    t = empty_hugepages((3, 1024, 1024), torch.float32)  # 12 MiB: the madvise path
    assert t.shape == (3, 1024, 1024) and t.is_contiguous() and t.data_ptr() % (2 * 2**20) == 0
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()
    small = empty_hugepages((5, 7), torch.bfloat16)
    assert small.shape == (5, 7) and small.dtype == torch.bfloat16


def test_dense_weights_clone_is_independent():
    ffn = packed("relu", "fp32", 0, 64, 100, 0)
    dense = kernels.dense_weights(ffn)
    assert kernels.dense_weights(ffn) is dense  # cached
    copy = dense.clone()
    assert copy.gate_up.data_ptr() != dense.gate_up.data_ptr() and copy.nbytes == dense.nbytes
    x = inputs(64, 0)
    a = kernels.dense_ffn(x, dense, torch.empty(64))
    b = kernels.dense_ffn(x, copy, torch.empty(64))
    assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_predict_active_per_neuron_thresholds(seed, threads):
    """A predictor bias folded into per-neuron thresholds selects exactly the neurons whose
    biased logit passes the scalar threshold (independent check in plain torch)."""
    g = torch.Generator().manual_seed(seed)
    d, r, n = 96, 16, 700
    x, fc1, fc2 = torch.randn(d, generator=g), torch.randn(r, d, generator=g), torch.randn(n, r, generator=g)
    bias = torch.randn(n, generator=g) * 3
    want = torch.nonzero(fc2 @ torch.relu(fc1 @ x) + bias >= 0.5).reshape(-1).tolist()
    thr = (0.5 - bias).contiguous()
    kernels.set_threads(threads)
    for fn in (kernels.predict_active, reference.predict_active_ref):
        out = torch.empty(n, dtype=torch.int32)
        k = fn(x, fc1, fc2, 0.5, out, neuron_thresholds=thr)
        assert out[:k].tolist() == want
