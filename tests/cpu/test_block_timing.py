"""The decode blocks' phase timing (``cpu.set_block_timing``, ``cpu.block_times``): off by
default; on, each phase a block has takes time and the phases it does not have take none (a
dense FFN has no predictor and no gates; a sparse one without q4 gate rows no gates), the sum is
within the wall time of the calls, and a reset starts from zero."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sparseinfer import cpu

from .test_block_decode import make, rope_row, rope_tables
from .test_sparse_block import D, S, block_kw, predictor, spec

CALLS = 5


@pytest.fixture
def timing():
    cpu.block_times(reset=True)
    cpu.set_block_timing(True)
    yield
    cpu.set_block_timing(False)
    cpu.block_times(reset=True)


def decode(blk, kw, calls: int = CALLS) -> float:
    """``calls`` tokens through ``blk`` at positions 0.., the wall time they took (s)."""
    nkv, hd = kw["n_kv_heads"], kw["head_dim"]
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(nkv, S, hd), torch.zeros(nkv, S, hd)
    x = torch.randn(kw["d_model"], generator=g)
    t0 = time.perf_counter()
    for pos in range(calls):
        blk(x, pos, kc, vc, *rope_row(hd, pos))
    return time.perf_counter() - t0


def sparse_block(dtype: str, block: int):
    kw, packed = block_kw("reglu", dtype, block, seed=3, down_bias=False)
    fc1, fc2 = predictor(3)
    pred = cpu.F16Predictor(fc1, fc2, torch.full((packed.d_ff,), -1e9))  # every neuron
    return kw, cpu.DecodeBlock(**kw, sparse=spec(packed, pred, on_residual=False))


def test_phases_are_named_in_order():
    assert cpu.BLOCK_PHASES == ("qkv", "attention", "wo", "predictor", "gates", "ffn", "rest")
    assert list(cpu.block_times()) == list(cpu.BLOCK_PHASES)


def test_off_by_default_reads_nothing():
    cpu.block_times(reset=True)
    kw = make(np.random.default_rng(0))
    decode(cpu.DecodeBlock(**kw), kw)
    assert set(cpu.block_times().values()) == {0.0}


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_dense_block_times_its_phases(threads, timing):
    kw = make(np.random.default_rng(0))
    wall = decode(cpu.DecodeBlock(**kw), kw)
    t = cpu.block_times()
    assert all(t[p] > 0 for p in ("qkv", "attention", "wo", "ffn", "rest")), t
    assert t["predictor"] == t["gates"] == 0.0
    assert sum(t.values()) <= wall


@pytest.mark.parametrize("dtype,block,gates", [("int8+q4g", 32, True), ("int8", 32, False),
                                               ("q4", 0, False)])
def test_sparse_block_times_its_predictor_and_gates(timing, dtype, block, gates):
    kw, blk = sparse_block(dtype, block)
    wall = decode(blk, kw)
    t = cpu.block_times()
    assert all(t[p] > 0 for p in ("qkv", "attention", "wo", "predictor", "ffn", "rest")), t
    assert (t["gates"] > 0) == gates
    assert sum(t.values()) <= wall


def test_a_step_of_several_rows_is_timed_too(timing):
    """``DecodeBlock.rows`` (a continuous-batching step) goes through the same phases."""
    kw = make(np.random.default_rng(2))
    blk, B = cpu.DecodeBlock(**kw), 3
    nkv, hd = kw["n_kv_heads"], kw["head_dim"]
    kc, vc = torch.zeros(4, nkv, S, hd), torch.zeros(4, nkv, S, hd)
    x = torch.randn(B, kw["d_model"], generator=torch.Generator().manual_seed(2))
    t0 = time.perf_counter()
    positions, slots = (torch.tensor(v, dtype=torch.int32) for v in ([0, 5, 2], [3, 0, 1]))
    blk.rows(x, positions, slots, kc, vc, *rope_tables(hd, S))
    wall = time.perf_counter() - t0
    t = cpu.block_times()
    assert all(t[p] > 0 for p in ("qkv", "attention", "wo", "ffn", "rest")), t
    assert t["predictor"] == t["gates"] == 0.0 and sum(t.values()) <= wall


def test_reset_and_switching_off(timing):
    kw = make(np.random.default_rng(1), d=D)
    blk = cpu.DecodeBlock(**kw)
    decode(blk, kw, calls=2)
    first = cpu.block_times(reset=True)
    assert sum(first.values()) > 0
    assert set(cpu.block_times().values()) == {0.0}
    cpu.set_block_timing(False)
    decode(blk, kw, calls=2)
    assert set(cpu.block_times().values()) == {0.0}


def test_a_models_decode_splits_into_its_blocks_phases(tiny_model_dir, timing):
    """A model's decode steps (every layer a C block) timed: each layer's phases add up, per
    token, to at most the step's wall time; ``bench.token_split`` puts the rest outside, and
    ``bench.timed_split`` does both around a run."""
    from sparseinfer.bench import timed_split, token_split
    from sparseinfer.models.build import load

    model = load(tiny_model_dir("swiglu"), "fp32", fused=True).model
    cache = model.new_cache(1, 32)
    model(torch.tensor([[1, 7, 3]]), 0, cache, last_only=True)
    cpu.block_times(reset=True)
    tok, steps = torch.tensor([[4]]), 6
    t0 = time.perf_counter()
    for i in range(steps):
        tok = model(tok, 3 + i, cache).argmax(-1)
    wall = time.perf_counter() - t0
    phases = cpu.block_times()
    split = token_split(phases, wall, steps)
    assert set(split) == {"qkv", "attention", "wo", "ffn", "rest", "outside"}
    assert split["outside"] >= 0
    assert sum(split.values()) == pytest.approx(wall * 1e3 / steps)
    assert token_split(dict.fromkeys(phases, 0.0), wall, steps) == {}

    # bench.timed_split: the same around a run of steps, the timers off again after it
    def run():
        t = tok
        for i in range(steps):
            t = model(t, 3 + steps + i, cache).argmax(-1)

    wall2, split2 = timed_split(run, steps)
    assert set(split2) == set(split) and split2["outside"] >= 0
    assert sum(split2.values()) == pytest.approx(wall2 * 1e3 / steps)
    model(tok, 3 + 2 * steps, cache)
    assert set(cpu.block_times().values()) == {0.0}
