"""Bundles of q4 ups (``PackedFFN`` dtype "q4i8"): a ReLU gate's rows apart as q4 rows, and each
neuron's bundle its down row's scales, its up row as a q4 row (a file's Q4_0 up rows, its own
numbers) and its int8 down row, one contiguous read where the gate fired. The kernels are
``cpu.sparse_ffn_i8_q4g`` (one token) and ``cpu.sparse_ffn_i8(..., gates=)`` (several tokens,
masks), given uint8 bundles and no scales.

- Against a float64 reference whose gate and up rows are gguf-py's dequantized Q4_0 blocks (an
  independent decoder) and whose down rows are the int8 bundles' numbers they were made from, on
  x as the kernels round it; ReGLU and dReLU, every ISA and thread count here, widths with and
  without AVX-512's groups of 4 blocks, sets that fill and do not fill the passes of 8.
- One token alone, in a batch, and the fired neurons alone sum the same terms; more tokens
  than a pass holds (split by neurons, by tokens), a token's row its own bits beside others.
- ``PackedFFN``: ``with_q4_ups`` keeps the gate, up and down numbers (``rows_fp32``), the layout
  (bytes per neuron), ``select``; errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.config import FFN_KINDS
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN, q4_blocks, q4i8_layout, quantize_q4_rows

from .ffn_cases import assert_one_batch_masked, idx_of, random_ffn

gguf = pytest.importorskip("gguf")
EPS = torch.finfo(torch.float32).eps


def q4_ups_ffn(kind: str, d_model: int, d_ff: int, seed: int) -> tuple[PackedFFN, PackedFFN]:
    """(q4i8 bundles, the int8 bundles with gates apart they were made from): gate and up
    quantized from float rows to q4 rows, as a Q4_0 file holds them."""
    g = torch.Generator().manual_seed(seed + 100)
    gate, up = (torch.randn(d_ff, d_model, generator=g) / d_model ** 0.5 for _ in range(2))
    apart = random_ffn(kind, d_model, d_ff, seed, "int8", 32).with_q4_gates(quantize_q4_rows(gate))
    return apart.with_q4_ups(quantize_q4_rows(up)), apart


def gguf_rows(q4: torch.Tensor, d_model: int) -> torch.Tensor:
    """float64 rows of q4 rows by gguf-py's Q4_0 decoder."""
    raw = q4_blocks(q4).numpy()
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    return torch.from_numpy(np.ascontiguousarray(w.reshape(q4.shape[0], d_model))).double()


def reference(ffn: PackedFFN, ups: torch.Tensor, apart: PackedFFN, x: torch.Tensor,
              idx: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float64 out of one token and its tolerance: gates and ups from gguf-py, down rows the
    int8 numbers of ``apart``, x rounded as the kernels round it."""
    i = idx.long()
    if not len(i):
        return torch.zeros(ffn.d_model, dtype=torch.float64), 0.0
    g, u = gguf_rows(ffn.gates[i], ffn.d_model), gguf_rows(ups[i], ffn.d_model)
    down = apart.rows_fp32(i)[:, 2].double()
    xr = cpu_ref.rounded_x(x).double()
    z, a = g @ xr, u @ xr
    up = torch.relu(a) if FFN_KINDS[ffn.kind].up_act == "relu" else a
    h = torch.relu(z) * up
    mag = (torch.relu(g.abs() @ xr.abs()) * (u.abs() @ xr.abs())) @ down.abs()
    return h @ down, float(64 * EPS * (mag.max() + 1.0))


def ups_of(ffn: PackedFFN) -> torch.Tensor:
    lay = q4i8_layout(ffn.d_model, ffn.block)
    return ffn.rows[:, 0, lay.up:lay.down]


@pytest.mark.parametrize("kind", ["reglu", "drelu"])
@pytest.mark.parametrize("d_model", [96, 256])  # 96: not a multiple of AVX-512's 4-block groups
@pytest.mark.parametrize("k", [0, 1, 7, 45, 150])
def test_q4_ups_match_the_reference(kind, d_model, k, isa, threads):
    d_ff = 150
    ffn, apart = q4_ups_ffn(kind, d_model, d_ff, seed=k)
    ups = ups_of(ffn)
    idx = idx_of(d_ff, k, seed=k + 1)
    X = torch.randn(3, d_model, generator=torch.Generator().manual_seed(k))
    # one token: sparse_ffn_i8_q4g; several: sparse_ffn_i8 with the gates
    assert_one_batch_masked(ffn, X, idx, lambda x, i: reference(ffn, ups, apart, x, i))


@pytest.mark.parametrize("T", [40, 90])
def test_more_tokens_than_a_pass_holds(T, threads):
    """More tokens than a pass of the per-token queues (16): 40 split between the threads by
    neurons, 90 by tokens; with and without a mask, each row within the reference's tolerance,
    and a token's row the same bits beside other tokens."""
    ffn, apart = q4_ups_ffn("reglu", 64, 90, seed=T)
    ups = ups_of(ffn)
    idx = torch.arange(0, 90, 2, dtype=torch.int32)
    X = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.rand(T, idx.numel(), generator=torch.Generator().manual_seed(3)) < 0.6
    got = kernels.sparse_ffn_batch(X, ffn, idx, torch.full((T, 64), float("nan")))
    got_m = kernels.sparse_ffn_batch(X, ffn, idx, torch.full((T, 64), float("nan")), mask)
    for t in range(T):
        want, tol = reference(ffn, ups, apart, X[t], idx)
        torch.testing.assert_close(got[t].double(), want, rtol=0, atol=tol)
        want, tol = reference(ffn, ups, apart, X[t], idx[mask[t]])
        torch.testing.assert_close(got_m[t].double(), want, rtol=0, atol=tol)
    X2 = torch.randn(T, 64, generator=torch.Generator().manual_seed(4))
    X2[0] = X[0]
    again = kernels.sparse_ffn_batch(X2, ffn, idx, torch.full((T, 64), float("nan")))
    assert torch.equal(again[0], got[0])


def test_one_token_a_batch_and_the_fired_alone_agree(isa):
    """The gates are ``sparse_q4_gates``' bits and the up products each row's own in any pass:
    one token alone, in a batch, and over its fired neurons alone differ by summation order."""
    ffn, apart = q4_ups_ffn("reglu", 256, 200, seed=8)
    idx = idx_of(200, 120, seed=9)
    x = torch.randn(256, generator=torch.Generator().manual_seed(10))
    fired = idx[cpu.sparse_q4_gates(ffn.gates, idx, x) > 0]
    alone, in_batch, only_fired = torch.empty(256), torch.empty(2, 256), torch.empty(256)
    kernels.sparse_ffn(x, ffn, idx, alone)
    kernels.sparse_ffn_batch(torch.stack([x, -x]), ffn, idx, in_batch)
    kernels.sparse_ffn(x, ffn, fired, only_fired)
    _, tol = reference(ffn, ups_of(ffn), apart, x, idx)
    torch.testing.assert_close(alone, in_batch[0], rtol=0, atol=tol)
    torch.testing.assert_close(alone, only_fired, rtol=0, atol=tol)


def test_packed_ffn_q4_ups_rules():
    ffn, apart = q4_ups_ffn("reglu", 64, 20, seed=0)
    lay = q4i8_layout(64, 32)
    assert (lay.up, lay.down, lay.width) == (8, 8 + 36, 8 + 36 + 64)
    assert q4i8_layout(4096, 32).width == 6912  # a 7B row: 512 + 2,304 + 4,096 bytes
    assert q4i8_layout(32, 32).width == 56  # 4 + 18 + 32, rounded up to 4
    assert ffn.dtype == "q4i8" and ffn.rows.shape == (20, 1, lay.width) and ffn.scales is None
    g = torch.Generator().manual_seed(100)  # (q4_ups_ffn's draws: the up rows that went in)
    _, up = (torch.randn(20, 64, generator=g) / 8 for _ in range(2))
    b = ffn.rows[:, 0]  # the bundle byte by byte: down scales, q4 up row, int8 down row, padding
    assert torch.equal(b[:, :lay.up], apart.scales[:, 1].contiguous().view(torch.uint8))
    assert torch.equal(ups_of(ffn), quantize_q4_rows(up))
    assert torch.equal(b[:, lay.down:lay.down + 64], apart.rows[:, 1].view(torch.uint8))
    assert ffn.stored_mats == 1 and ffn.n_mats == 3 and torch.equal(ffn.gates, apart.gates)
    w = ffn.rows_fp32()  # gate and up by gguf-py's decoder, down the int8 bundles' numbers
    assert torch.equal(w[:, 0].double(), gguf_rows(ffn.gates, 64))
    assert torch.equal(w[:, 1].double(), gguf_rows(ups_of(ffn), 64))
    assert torch.equal(w[:, 2], apart.rows_fp32()[:, 2])
    assert ffn.bytes_per_neuron == lay.width + 36
    assert ffn.nbytes == 20 * (lay.width + 36)
    sel = ffn.select(torch.tensor([5, 2, 19]))
    assert torch.equal(sel.rows_fp32(), w[[5, 2, 19]]) and sel.dtype == "q4i8"
    with pytest.raises(ValueError, match="expected int8 bundles with their gates apart"):
        ffn.with_q4_ups(ups_of(ffn))
    whole = random_ffn("reglu", 64, 20, 0, "int8", 32)
    with pytest.raises(ValueError, match=r"got int8 rows \(no gates\)"):
        whole.with_q4_ups(ups_of(ffn))
    with pytest.raises(ValueError, match=r"ups: expected uint8 \(20, 36\), got uint8 \(20, 18\)"):
        apart.with_q4_ups(ups_of(ffn)[:, :18])
    with pytest.raises(ValueError, match="expected the q4 gate rows apart for dtype 'q4i8'"):
        replace(ffn, gates=None)
    with pytest.raises(ValueError, match="expected 1..64/None for q4i8"):
        replace(ffn, scales=apart.scales)


def test_q4_ups_errors():
    ffn, apart = q4_ups_ffn("reglu", 64, 8, seed=0)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    x, out = torch.zeros(1, 64), torch.empty(1, 64)
    with pytest.raises(ValueError, match="scales: expected None with q4 ups"):
        cpu.sparse_ffn_i8_q4g(ffn.rows, apart.scales, 32, ffn.gates, idx, x, out, 0)
    with pytest.raises(ValueError, match=r"rows: expected contiguous uint8 \[d_ff, 1, 108\]"):
        cpu.sparse_ffn_i8(ffn.rows[:, :, :100].contiguous(), None, 32, True, idx, x, out, 1, 0,
                          gates=ffn.gates)
    with pytest.raises(ValueError, match="round_x: q4 ups take x rounded"):
        cpu.sparse_ffn_i8(ffn.rows, None, 32, True, idx, x, out, 1, 0, round_x=False,
                          gates=ffn.gates)
    with pytest.raises(ValueError, match="need a ReLU gate"):  # SiLU's code: 2
        cpu.sparse_ffn_i8(ffn.rows, None, 32, True, idx, x, out, 2, 0, gates=ffn.gates)
    with pytest.raises(IndexError, match=r"expected neuron indices in \[0, 8\)"):
        kernels.sparse_ffn(torch.zeros(64), ffn, torch.tensor([1, 8], dtype=torch.int32),
                           torch.empty(64))
