"""int8 neuron bundles of a ReLU gate with their gate rows apart as q4 rows (``PackedFFN.gates``:
a file's Q4_0 gate rows, its own numbers; the bundles hold the up and down rows):
``cpu.sparse_ffn_i8_q4g`` (one token: every gate over the q4 rows, then the fired neurons' int8
up and down rows) and ``cpu.sparse_ffn_i8(..., gates=)`` (any tokens, masks: the gates of each
pass from the q4 rows), as ``kernels.sparse_ffn`` / ``sparse_ffn_batch`` pick them.

- Against a float64 reference whose gates are gguf-py's dequantized Q4_0 blocks of those rows
  (an independent decoder) and whose up and down rows are the bundles' int8 numbers, on x as the
  kernels round it; ReGLU and dReLU, every ISA and thread count here, sets that fill and do not
  fill the passes, one token and several, with and without a mask.
- Given whole bundles (an int8 gate row first) and the gates apart, the kernels read no int8
  gate row: with those rows' scales blown up, the outputs are the two-row bundles' own.
- A neuron's gate is the same bits in both kernels (the fired sets agree with
  ``cpu.sparse_q4_gates``), so one token decoded alone and in a batch sums the same terms.
- ``PackedFFN``: ``rows_fp32`` puts the gate rows back in their place; gates refused where they
  do not apply; ``select`` and ``packed_to_device`` carry them; errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels
from sparseinfer.sparse.ffn import packed_to_device
from sparseinfer.sparse.packed import PackedFFN, q4_blocks, quantize_q4_rows

from .ffn_cases import assert_one_batch_masked, idx_of, random_ffn

gguf = pytest.importorskip("gguf")
EPS = torch.finfo(torch.float32).eps


def ffn_with_gates(kind: str, d_model: int, d_ff: int, seed: int) -> PackedFFN:
    """int8 bundles (scales per 32) of up and down rows, the gate apart as q4 rows (quantized
    from the float gate, as a Q4_0 file holds them)."""
    return whole_bundles(kind, d_model, d_ff, seed).with_q4_gates(
        quantize_q4_rows(random_gate(d_model, d_ff, seed)))


def whole_bundles(kind: str, d_model: int, d_ff: int, seed: int) -> PackedFFN:
    return random_ffn(kind, d_model, d_ff, seed, "int8", 32)


def random_gate(d_model: int, d_ff: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # (random_ffn's gate: the first draw)
    return torch.randn(d_ff, d_model, generator=gen) / d_model ** 0.5


def reference(ffn: PackedFFN, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float64 out of one token and its tolerance: gates from gguf-py's decoder of the q4 rows'
    Q4_0 blocks, up/down the bundles' int8 numbers, x rounded as the kernels round it."""
    i = idx.long()
    if not len(i):
        return torch.zeros(ffn.d_model, dtype=torch.float64), 0.0
    raw = q4_blocks(ffn.gates[i]).numpy()
    g = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(
        raw, gguf.GGMLQuantizationType.Q4_0).reshape(len(i), ffn.d_model))).double()
    w = ffn.rows_fp32(i).double()  # (gate, up, down): up and down are the int8 numbers
    xr = cpu_ref.rounded_x(x).double()
    z, u = g @ xr, w[:, 1] @ xr
    up = torch.relu(u) if FFN_KINDS[ffn.kind].up_act == "relu" else u
    h = torch.relu(z) * up
    # float32 slack of the kernels' sums: the gate/up products and the down axpys
    mag = (torch.relu(g.abs() @ xr.abs()) * (w[:, 1].abs() @ xr.abs())) @ w[:, 2].abs()
    return h @ w[:, 2], float(64 * EPS * (mag.max() + 1.0))


@pytest.mark.parametrize("kind", ["reglu", "drelu"])
@pytest.mark.parametrize("k", [0, 1, 7, 45, 150])
def test_q4_gates_match_the_reference(kind, k, isa, threads):
    d_model, d_ff = 96, 150  # 96: not a multiple of 128 (AVX-512's groups of 4 blocks)
    ffn = ffn_with_gates(kind, d_model, d_ff, seed=k)
    idx = idx_of(d_ff, k, seed=k + 1)
    X = torch.randn(3, d_model, generator=torch.Generator().manual_seed(k))
    # one token: sparse_ffn_i8_q4g; several: sparse_ffn_i8 with the gates
    assert_one_batch_masked(ffn, X, idx, lambda x, i: reference(ffn, x, i))


def test_whole_bundles_with_gates_apart_skip_their_int8_gates(isa, threads):
    """Scales of 1e30 on every int8 gate row of whole bundles: a read would blow the output up."""
    ffn = ffn_with_gates("reglu", 128, 90, seed=3)
    whole = whole_bundles("reglu", 128, 90, seed=3)
    scales = whole.scales.clone()
    scales[:, 0] = 1e30
    idx = idx_of(90, 60, seed=4)
    X = torch.randn(2, 128, generator=torch.Generator().manual_seed(6))
    one, two = torch.empty(1, 128), torch.empty(2, 128)
    cpu.sparse_ffn_i8_q4g(whole.rows, scales, 32, ffn.gates, idx, X[:1], one, 0)
    cpu.sparse_ffn_i8(whole.rows, scales, 32, True, idx, X, two, 1, 0, gates=ffn.gates)
    for t, got in ((0, one[0]), (0, two[0]), (1, two[1])):
        want, tol = reference(ffn, X[t], idx)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    bad = torch.empty(128)  # without the gates apart the same bundles read them
    kernels.sparse_ffn(X[0], replace(whole, scales=scales), idx, bad)
    assert bad.abs().max() > 1e20


def test_one_token_and_a_batch_fire_the_same_neurons(isa):
    """The gates are ``sparse_q4_gates``' bits in both kernels: a ReLU neuron fires in one
    exactly where it fires in the other, and the outputs differ only by summation order."""
    ffn = ffn_with_gates("reglu", 256, 200, seed=8)
    idx = idx_of(200, 120, seed=9)
    x = torch.randn(256, generator=torch.Generator().manual_seed(10))
    z = cpu.sparse_q4_gates(ffn.gates, idx, x)
    fired = idx[z > 0]
    alone, in_batch = torch.empty(256), torch.empty(2, 256)
    kernels.sparse_ffn(x, ffn, idx, alone)
    kernels.sparse_ffn_batch(torch.stack([x, -x]), ffn, idx, in_batch)
    only_fired = torch.empty(256)
    kernels.sparse_ffn(x, ffn, fired, only_fired)  # neurons not fired add nothing
    _, tol = reference(ffn, x, idx)
    torch.testing.assert_close(alone, in_batch[0], rtol=0, atol=tol)
    torch.testing.assert_close(alone, only_fired, rtol=0, atol=tol)


def test_packed_ffn_gates_rules():
    whole = whole_bundles("reglu", 64, 20, seed=0)
    ffn = ffn_with_gates("reglu", 64, 20, seed=0)
    assert ffn.rows.shape == (20, 2, 64) and ffn.stored_mats == 2 and ffn.n_mats == 3
    assert torch.equal(ffn.rows, whole.rows[:, 1:]) and torch.equal(ffn.scales, whole.scales[:, 1:])
    w = ffn.rows_fp32()  # the gate in its place: the q4 rows' numbers, by gguf-py too
    g = gguf.quants.dequantize(q4_blocks(ffn.gates).numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(w[:, 0], torch.from_numpy(g.reshape(20, 64)))
    assert torch.equal(w[:, 1:], whole.rows_fp32()[:, 1:])
    gate, up, down = ffn.dequantized()
    assert torch.equal(gate, w[:, 0]) and torch.equal(down, whole.dequantized()[2])
    assert ffn.nbytes == whole.nbytes - 20 * (64 + 2 * 4) + ffn.gates.numel()
    assert ffn.bytes_per_neuron == 2 * (64 + 2 * 4) + 36
    sel = ffn.select(torch.tensor([5, 2, 19]))
    assert torch.equal(sel.gates, ffn.gates[[5, 2, 19]])
    assert torch.equal(sel.rows_fp32(), w[[5, 2, 19]])
    assert torch.equal(packed_to_device(ffn, torch.device("cpu")).gates, ffn.gates)
    with pytest.raises(ValueError, match="already apart"):
        ffn.with_q4_gates(ffn.gates)
    with pytest.raises(ValueError, match=r"rows: expected shape \(20, 2, 64\)"):
        replace(whole, gates=ffn.gates)
    swiglu = random_ffn("swiglu", 64, 20, 0, "int8", 32)
    with pytest.raises(ValueError, match="only for int8 bundles of a ReLU gate"):
        replace(swiglu, gates=ffn.gates)
    q4 = random_ffn("reglu", 64, 20, 0, "q4")
    with pytest.raises(ValueError, match="only for int8 bundles of a ReLU gate"):
        replace(q4, gates=ffn.gates)
    with pytest.raises(ValueError, match=r"gates: expected contiguous uint8 \(20, 36\)"):
        replace(ffn, gates=ffn.gates[:, :32])
    per8 = random_ffn("reglu", 64, 20, 0, "int8", 8)
    with pytest.raises(ValueError, match="scale blocks a multiple of 32"):
        replace(per8, gates=ffn.gates)


def test_q4_gates_errors():
    ffn = ffn_with_gates("reglu", 64, 8, seed=0)
    whole = whole_bundles("reglu", 64, 8, seed=0)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    x, out = torch.zeros(1, 64), torch.empty(1, 64)
    with pytest.raises(ValueError, match=r"gates: expected CPU uint8 \[8, 36\] q4 rows"):
        cpu.sparse_ffn_i8_q4g(ffn.rows, ffn.scales, 32, ffn.gates[:4], idx, x, out, 0)
    with pytest.raises(ValueError, match=r"x: expected float32 \[1, d_model\] \(one token\)"):
        cpu.sparse_ffn_i8_q4g(ffn.rows, ffn.scales, 32, ffn.gates, idx, torch.zeros(2, 64),
                              torch.empty(2, 64), 0)
    with pytest.raises(ValueError, match="need a ReLU gate"):  # SiLU's code: 2
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, True, idx, x, out, 2, 0, gates=ffn.gates)
    with pytest.raises(ValueError, match="need a ReLU gate"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, True, idx, x, out, 1, 0, round_x=False,
                          gates=ffn.gates)
    with pytest.raises(ValueError, match=r"rows: expected contiguous int8 \[d_ff, 3, d_model\]"):
        cpu.sparse_ffn_i8(ffn.rows, ffn.scales, 32, True, idx, x, out, 1, 0)  # no gates given
    with pytest.raises(ValueError, match=r"scales: expected contiguous float32 \[8, 2, 2\]"):
        cpu.sparse_ffn_i8_q4g(ffn.rows, whole.scales, 32, ffn.gates, idx, x, out, 0)
    with pytest.raises(IndexError, match=r"expected neuron indices in \[0, 8\)"):
        kernels.sparse_ffn(torch.zeros(64), ffn, torch.tensor([1, 8], dtype=torch.int32),
                           torch.empty(64))
