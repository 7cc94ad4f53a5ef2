"""A block whose FFN is sparse, whole in C (``cpu.DecodeBlock(sparse=cpu.SparseBlockFFN(...))``:
the predictor and the neuron bundles inside the block's one call) against its float64 reference
(``reference.block_decode_ref`` with the sparse FFN's reference: the predictor's logits from its
float16 weights in float64, ``sparse_ffn_ref`` over the neurons they select, on x as the kernels
round it); and a step of several rows against each row's lone call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as ref
from sparseinfer.sparse.packed import quantize_q4_rows
from sparseinfer.sparse.reference import sparse_ffn_ref

from .ffn_cases import batched_int8, random_ffn, ref_x
from .test_block_decode import make, rope_row

# (FFN kind, rows, int8 scale block: 0 one per row); "int8+q4g": int8 up and down rows, the
# ReLU gate's rows apart as q4 rows; "q4i8": those gates apart, the up rows q4 rows too
CASES = [("swiglu", "int8", 32), ("reglu", "int8", 32), ("swiglu", "q4", 0), ("relu", "int8", 0),
         ("geglu", "q4", 0), ("reglu", "int8+q4g", 32), ("drelu", "int8+q4g", 32),
         ("reglu", "q4i8", 32), ("drelu", "q4i8", 32)]
D, D_FF, RANK, S = 64, 96, 32, 48


def predictor(seed: int):
    g = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(RANK, D, generator=g) / D**0.5).half()
    fc2 = (torch.randn(D_FF, RANK, generator=g) / RANK**0.5).half()
    return fc1, fc2


def logits_of(fc1, fc2, v):
    return fc2.double() @ torch.relu(fc1.double() @ v.double())


def block_kw(kind: str, dtype: str, block: int, seed: int, down_bias: bool):
    """The block's arguments but the FFN, its packed rows, and a down bias (or None)."""
    k = FFN_KINDS[kind]
    kw = make(np.random.default_rng(seed), d=D, d_ff=D_FF, gated=k.gated, gate_act=k.gate_act,
              up_act=k.up_act)
    kw.update(w_in=[], down=[])
    g = torch.Generator().manual_seed(seed)
    kw["biases"] = {"down": torch.randn(D, generator=g) * 0.1 if down_bias else None}
    if dtype in ("int8+q4g", "q4i8"):
        g = torch.Generator().manual_seed(seed + 1)
        gate, up = (torch.randn(D_FF, D, generator=g) / D**0.5 for _ in range(2))
        apart = random_ffn(kind, D, D_FF, seed=seed, dtype="int8", block=block).with_q4_gates(
            quantize_q4_rows(gate))
        return kw, apart.with_q4_ups(quantize_q4_rows(up)) if dtype == "q4i8" else apart
    return kw, random_ffn(kind, D, D_FF, seed=seed, dtype=dtype, block=block)


def spec(packed, pred, on_residual: bool, mode: int = 0) -> cpu.SparseBlockFFN:
    int8 = packed.dtype in ("int8", "q4i8")
    from sparseinfer.sparse import kernels

    return cpu.SparseBlockFFN(
        rows=packed.rows, scales=packed.scales if int8 else None,
        block=packed.block if int8 else 0, round_x=kernels.rounds_x(packed),
        up_bias=packed.up_bias, predictor=pred, on_residual=on_residual,
        mode=np.array([mode], dtype=np.int32), counts=np.zeros(2, dtype=np.int64),
        gates=packed.gates)


def far_thresholds(logits: torch.Tensor, seed: int, share: float = 0.6) -> torch.Tensor:
    """Per-neuron thresholds half a standard deviation of the logits away from them, a random
    ``share`` below (selected): the kernels' float32 inputs select exactly what the float64
    reference's select."""
    sel = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(seed)) < share
    gap = 0.5 * logits.std()
    return torch.where(sel, logits - gap, logits + gap).float()


@pytest.mark.parametrize("kind,dtype,block", CASES)
@pytest.mark.parametrize("on_residual", [False, True])
@pytest.mark.parametrize("pos", [0, 9])
@pytest.mark.parametrize("selector", ["predictor", "every"])
def test_sparse_block_matches_reference(isa, threads, kind, dtype, block, on_residual, pos,
                                        selector):
    seed = pos + len(kind)
    kw, packed = block_kw(kind, dtype, block, seed, down_bias=on_residual)
    g = torch.Generator().manual_seed(seed)
    nkv, hd = kw["n_kv_heads"], kw["head_dim"]
    kc, vc = torch.randn(nkv, S, hd, generator=g), torch.randn(nkv, S, hd, generator=g)
    x = torch.randn(D, generator=g)
    cos, sin = rope_row(hd, pos)
    fc1, fc2 = predictor(seed)

    seen = {}

    def capture(h, xr):  # the FFN's inputs in the reference, for thresholds far from them
        seen["in"] = xr if on_residual else h
        return torch.zeros(D, dtype=torch.float64)

    ref.block_decode_ref(**kw, x=x.clone(), pos=pos, k_cache=kc.clone(), v_cache=vc.clone(),
                         cos=cos, sin=sin, ffn=capture)
    thr = far_thresholds(logits_of(fc1, fc2, seen["in"]), seed)
    chosen = {}

    def sparse_ref(h, xr):
        v = xr if on_residual else h
        idx = (torch.arange(D_FF) if selector == "every" else
               torch.nonzero(logits_of(fc1, fc2, v) >= thr).reshape(-1))
        chosen["k"] = idx.numel()
        return sparse_ffn_ref(ref_x(packed, h.float()), packed, idx.to(torch.int32),
                              torch.empty(D)).double()

    kr, vr = kc.clone(), vc.clone()
    want = ref.block_decode_ref(**kw, x=x.clone(), pos=pos, k_cache=kr, v_cache=vr, cos=cos,
                                sin=sin, ffn=sparse_ref)
    pred = cpu.F16Predictor(fc1, fc2, thr) if selector == "predictor" else None
    sp = spec(packed, pred, on_residual)
    blk = cpu.DecodeBlock(**kw, sparse=sp)
    got = x.clone()
    blk(got, pos, kc, vc, cos, sin)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * scale)
    torch.testing.assert_close(kc, kr, rtol=1e-3, atol=1e-3)
    assert 0 < chosen["k"] and sp.counts.tolist() == [1, chosen["k"]]


def three_rows(kw, seed: int):
    """Three rows' caches [3, n_kv_heads, S, head_dim] and inputs [3, D], a predictor whose
    thresholds sit at the median logit of a random input, and rope tables of every position."""
    g = torch.Generator().manual_seed(seed)
    nkv, hd = kw["n_kv_heads"], kw["head_dim"]
    kc, vc = torch.randn(3, nkv, S, hd, generator=g), torch.randn(3, nkv, S, hd, generator=g)
    x = torch.randn(3, D, generator=g)
    fc1, fc2 = predictor(seed)
    thr = torch.full((D_FF,), float(logits_of(fc1, fc2, torch.randn(D, generator=g)).median()))
    half = hd // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * torch.cat([inv, inv])
    return (kc, vc, x, cpu.F16Predictor(fc1, fc2, thr), ang.cos().float().contiguous(),
            ang.sin().float().contiguous())


@pytest.mark.parametrize("kind,dtype,block", CASES)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_sparse_rows_are_lone_calls(isa, threads, kind, dtype, block, mode):
    """Three sequences' tokens in one call (``DecodeBlock.rows``): mode 0, each row its own set
    (a mask over the union), gives each row its lone call's numbers — int8 rows its bits (one
    thread: on two, a call's neuron ranges split the union elsewhere than a lone call's set),
    except through the batched int8 pass (AVX-512, gate not ReLU: sums in another order);
    mode 2, every neuron, that of a block that selects every neuron; mode 1, the union of the
    rows' sets, every row over the same neurons (the reference over them)."""
    seed = 5 + len(kind)
    kw, packed = block_kw(kind, dtype, block, seed, down_bias=True)
    slots, positions = [2, 0, 1], [5, 9, 0]
    kc, vc, x, pred, cos, sin = three_rows(kw, seed)
    sp = spec(packed, pred, False, mode)
    blk = cpu.DecodeBlock(**kw, sparse=sp)
    lone_sp = spec(packed, pred if mode != 2 else None, False)
    lone = cpu.DecodeBlock(**kw, sparse=lone_sp)
    kr, vr = kc.clone(), vc.clone()
    got = blk.rows(x.clone(), torch.tensor(positions, dtype=torch.int32),
                   torch.tensor(slots, dtype=torch.int32), kc, vc, cos, sin)
    alone = x.clone()
    for t, (slot, pos) in enumerate(zip(slots, positions)):
        lone(alone[t], pos, kr[slot], vr[slot], cos[pos], sin[pos])
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    k_lone = lone_sp.counts[1]  # the rows' own sets, summed
    if mode == 1:  # the union, wider than a row's own set: not its lone call
        assert sp.counts[0] == 3 and sp.counts[1] % 3 == 0 and sp.counts[1] >= k_lone
        assert not torch.equal(got, alone)
        return
    assert sp.counts.tolist() == ([3, k_lone] if mode == 0 else [0, 0])
    if dtype.startswith("int8") and not batched_int8(kind, isa):
        assert torch.equal(got, alone)
    else:  # q4 rows, or the batched int8 pass: its sums in another order than a lone call's
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_sparse_block_errors():
    kw, packed = block_kw("swiglu", "int8", 32, 0, down_bias=False)
    fc1, fc2 = predictor(0)
    pred = cpu.F16Predictor(fc1, fc2, torch.zeros(D_FF))
    with pytest.raises(ValueError, match="w_in, down: expected none"):
        cpu.DecodeBlock(**{**kw, "w_in": make(np.random.default_rng(0), d=D, d_ff=D_FF)["w_in"]},
                        sparse=spec(packed, pred, False))
    other = random_ffn("swiglu", D, D_FF + 1, seed=0, dtype="int8", block=32)
    with pytest.raises(ValueError, match=f"rows: expected {D_FF} bundles"):
        cpu.DecodeBlock(**kw, sparse=spec(other, None, False))
    bad = cpu.SparseBlockFFN(**{**spec(packed, pred, False).__dict__,
                                "counts": np.zeros(2, dtype=np.int32)})
    with pytest.raises(ValueError, match=r"counts: expected a numpy int64 array \[2\]"):
        cpu.DecodeBlock(**kw, sparse=bad)


@pytest.mark.parametrize("kind,dtype,block",
                         [c for c in CASES if c[1] not in ("int8+q4g", "q4i8")])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_dense_copy_rows_are_a_dense_blocks(isa, threads, kind, dtype, block):
    """A sparse block given a dense copy of its FFN (``SparseBlockFFN.w_in`` / ``down``, mode
    3): several rows at once give a dense block's rows with those matrices, bit for bit (its
    products, every neuron, counted nowhere); one row stays the sparse FFN's lone call; mode 3
    without a copy is mode 2, every neuron over the bundles."""
    seed = 11 + len(kind)
    k = FFN_KINDS[kind]
    kw, packed = block_kw(kind, dtype, block, seed, down_bias=True)
    rng = np.random.default_rng(seed)
    dense = make(rng, d=D, d_ff=D_FF, gated=k.gated, gate_act=k.gate_act, up_act=k.up_act,
                 bias=True)
    w_in_bias = dense["biases"]["w_in"]
    slots, positions = [1, 0, 2], [4, 7, 0]
    kc, vc, x, pred, cos, sin = three_rows(kw, seed)

    def sparse_block(mode, copy):
        base = spec(packed, pred, False, mode)
        sp = cpu.SparseBlockFFN(**{**base.__dict__, **(
            {"w_in": tuple(dense["w_in"]), "down": tuple(dense["down"]),
             "w_in_bias": w_in_bias} if copy else {})})
        return cpu.DecodeBlock(**kw, sparse=sp), sp

    pos_t, slot_t = torch.tensor(positions, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)

    def rows(blk):
        return blk.rows(x.clone(), pos_t, slot_t, kc.clone(), vc.clone(), cos, sin)

    blk, sp = sparse_block(3, True)
    want = rows(cpu.DecodeBlock(**{**kw, "w_in": dense["w_in"], "down": dense["down"],
                                   "biases": {**kw["biases"], "w_in": w_in_bias}}))
    assert torch.equal(rows(blk), want)
    assert sp.counts.tolist() == [0, 0]
    lone, lone_sp = sparse_block(0, False)  # one row: the sparse FFN, not the copy
    one, one_lone = x[0].clone(), x[0].clone()
    blk(one, 4, kc[1].clone(), vc[1].clone(), cos[4], sin[4])
    lone(one_lone, 4, kc[1].clone(), vc[1].clone(), cos[4], sin[4])
    assert torch.equal(one, one_lone) and sp.counts[0] == 1 and sp.counts[1] > 0
    assert not torch.allclose(one, want[0])  # (the step's row 0: the same token and cache)
    no_copy, _ = sparse_block(3, False)
    every, _ = sparse_block(2, False)
    assert torch.equal(rows(no_copy), rows(every))


def test_dense_copy_errors():
    kw, packed = block_kw("swiglu", "int8", 32, 0, down_bias=False)
    dense = make(np.random.default_rng(0), d=D, d_ff=D_FF)
    base = spec(packed, None, False, 3).__dict__
    short = cpu.SparseBlockFFN(**{**base, "w_in": (dense["w_in"][0],), "down": tuple(dense["down"])})
    with pytest.raises(ValueError, match=f"w_in {2 * D_FF}x{D}"):
        cpu.DecodeBlock(**kw, sparse=short)
    no_down = cpu.SparseBlockFFN(**{**base, "w_in": tuple(dense["w_in"])})
    with pytest.raises(ValueError, match=r"down 64x96; got .*'down': \[\]"):
        cpu.DecodeBlock(**kw, sparse=no_down)
