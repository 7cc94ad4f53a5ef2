"""The raw gate dot products of q4 bundles alone (``cpu.sparse_q4_gates``,
``kernels.gate_dots``), for a caller that takes the ReLU gates of some neurons first (the disk
tier's cold neurons) and then runs the FFN kernel over the neurons whose gate fired.

- z against gguf-py's dequantized gate rows times the kernel's rounded x, over widths that are
  and are not multiples of 128 (AVX-512's groups of 4 blocks) and lists that fill and do not
  fill the kernel's passes of 8, every ISA and thread count here; each z the same bits whatever
  list it is computed in; gate rows read from bundles, from a strided view of them, and from an
  array of gate rows alone ending at an unreadable page (nothing past a gate row is read).
- ReGLU and dReLU: the kernel over idx and over idx with only the neurons whose z > 0 (a mask
  over the same list) give the same bits. The kernel's gate and up passes used to take a pass
  of under 8 rows through another summation than a full pass (plain AVX2), so a neuron's gate,
  and the output, moved in the last bits with the neurons around it: this failed there before
  (si_sparse_q4's FIXED_DOTS). A shorter list of the fired neurons alone gives the same bits
  while both calls are one chunk of the pool (up to 32 neurons); beyond that the pool's neuron
  ranges, and their partial sums, fall elsewhere, which the mask avoids (any valid row may
  stand at a masked neuron's place).
- Bad arguments raise clear errors."""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import replace

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.cpu import reference as cpu_ref
from sparseinfer.sparse import kernels
from sparseinfer.sparse.packed import PackedFFN, q4_blocks

from .ffn_cases import idx_of, random_ffn

gguf = pytest.importorskip("gguf")
EPS = torch.finfo(torch.float32).eps


def gate_ref(ffn: PackedFFN, x: torch.Tensor,
             idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``gate_i · rounded_x(x)`` with gguf-py's Q4_0 decoder, and the float32
    summation slack of the kernel's sums (per block products, nb + 16 roundings)."""
    raw = q4_blocks(ffn.rows[idx.long(), 0]).numpy()  # the q4 rows' Q4_0 blocks
    g = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).reshape(len(idx), ffn.d_model)
    g = torch.from_numpy(np.ascontiguousarray(g)).double()
    xr = cpu_ref.rounded_x(x).double()
    slack = (ffn.d_model // 32 + 16) * EPS * (g.abs() @ xr.abs()) + 1e-30
    return g @ xr, slack


def guarded_gate_rows(rows: torch.Tensor) -> torch.Tensor:
    """A copy of the gate rows [d_ff, width] whose last byte is the last readable one: the page
    after it is PROT_NONE, so a read past any gate row's end faults."""
    gates = rows[:, 0].contiguous().numpy()
    n, page = gates.nbytes, mmap.PAGESIZE
    total = (n + page - 1) // page * page + page
    buf = mmap.mmap(-1, total)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + total - page, page, 0) == 0  # PROT_NONE
    arr = np.frombuffer(buf, dtype=np.uint8)[total - page - n : total - page]
    arr[:] = gates.reshape(-1)
    return torch.from_numpy(arr).view(gates.shape)


@pytest.mark.parametrize("d_model", [96, 160, 256, 4096])  # 3, 5, 8, 128 blocks
@pytest.mark.parametrize("k", [1, 7, 8, 9, 100])
def test_gates_match_reference(d_model, k, isa, threads):
    d_ff = 120
    ffn = random_ffn("reglu", d_model, d_ff, seed=d_model, dtype="q4")
    for seed in range(2):
        idx = idx_of(d_ff, k, seed)
        if seed:  # not in order, and the last neuron (its gate row ends the guarded array)
            idx = torch.cat([idx[1:].flip(0), torch.tensor([d_ff - 1], dtype=torch.int32)])[:k]
            idx = idx.contiguous()
        x = torch.randn(d_model, generator=torch.Generator().manual_seed(seed + 5))
        z = cpu.sparse_q4_gates(ffn.rows, idx, x)
        assert z.shape == (k,) and z.dtype == torch.float32
        want, slack = gate_ref(ffn, x, idx)
        assert torch.all((z.double() - want).abs() <= slack), (z, want)
        # the same bits from any list holding the neuron (here: each alone), from a strided
        # view of the gate rows, from gate rows alone, and through kernels.gate_dots
        alone = torch.cat([cpu.sparse_q4_gates(ffn.rows, idx[i:i + 1].clone(), x)
                           for i in range(k)])
        assert torch.equal(z, alone)
        assert torch.equal(cpu.sparse_q4_gates(ffn.rows[:, 0], idx, x), z)
        assert torch.equal(cpu.sparse_q4_gates(guarded_gate_rows(ffn.rows), idx, x), z)
        out = torch.full((k,), float("nan"))
        assert kernels.gate_dots(x, ffn, idx.long(), out) is out and torch.equal(out, z)


def test_gates_of_a_long_list_over_the_pool(isa, threads):
    """Enough neurons for several of the pool's ranges: the same bits as one neuron at a time."""
    d_model, d_ff = 128, 2000
    ffn = random_ffn("drelu", d_model, d_ff, seed=1, dtype="q4")
    idx = idx_of(d_ff, 1500, seed=2)
    x = torch.randn(d_model, generator=torch.Generator().manual_seed(3))
    z = cpu.sparse_q4_gates(ffn.rows, idx, x)
    for i in range(0, 1500, 7):
        assert torch.equal(cpu.sparse_q4_gates(ffn.rows, idx[i:i + 1].clone(), x), z[i:i + 1])
    want, slack = gate_ref(ffn, x, idx)
    assert torch.all((z.double() - want).abs() <= slack)
    assert cpu.sparse_q4_gates(ffn.rows, idx[:0].clone(), x).shape == (0,)


SIZES = [1, 3, 7, 8, 9, 15, 16, 17, 25, 32, 33, 64, 100, 201, 300]


@pytest.mark.parametrize("kind", ["reglu", "drelu"])
@pytest.mark.parametrize("d_model", [96, 256])
def test_fired_neurons_alone_give_the_same_bits(kind, d_model, isa, threads):
    d_ff = 300
    ffn = random_ffn(kind, d_model, d_ff, seed=7, dtype="q4")
    for trial, k in enumerate(SIZES):
        for seed in range(3):
            idx = idx_of(d_ff, k, 100 * trial + seed)
            x = torch.randn(d_model, generator=torch.Generator().manual_seed(seed + 11))
            z = kernels.gate_dots(x, ffn, idx)
            fired = z > 0
            full = kernels.sparse_ffn(x, ffn, idx, torch.full((d_model,), float("nan")))
            masked = kernels.sparse_ffn_batch(x[None], ffn, idx, torch.empty(1, d_model),
                                              fired[None])[0]
            assert torch.equal(masked, full), (kind, k, seed)
            # the masked neurons' places may hold any valid row (their rows are not read)
            stand_in = torch.where(fired, idx, torch.zeros_like(idx))
            masked = kernels.sparse_ffn_batch(x[None], ffn, stand_in, torch.empty(1, d_model),
                                              fired[None])[0]
            assert torch.equal(masked, full), (kind, k, seed)
            if k <= 32:  # one chunk of the pool either way: the fired neurons alone
                alone = kernels.sparse_ffn(x, ffn, idx[fired].contiguous(), torch.empty(d_model))
                assert torch.equal(alone, full), (kind, k, seed)
            if kind == "reglu" and not fired.all():
                # z <= 0 is a gate the kernel found silent: NaN up rows there are never read
                rows = ffn.rows.clone()
                silent = idx[~fired].long()
                for b in range(d_model // 32):  # fp16 NaN scales in their up rows
                    rows[silent, 1, 18 * b] = 0x00
                    rows[silent, 1, 18 * b + 1] = 0x7E
                poisoned = replace(ffn, rows=rows)
                got = kernels.sparse_ffn(x, poisoned, idx, torch.empty(d_model))
                assert torch.equal(got, full)


def test_gate_errors():
    d_model, d_ff = 64, 10
    ffn = random_ffn("reglu", d_model, d_ff, seed=0, dtype="q4")
    x, idx = torch.randn(d_model), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="rows: expected uint8"):
        cpu.sparse_q4_gates(ffn.rows.to(torch.int8), idx, x)
    with pytest.raises(ValueError, match="rows: expected uint8"):
        cpu.sparse_q4_gates(ffn.rows[:, 0, 0].contiguous(), idx, x)
    with pytest.raises(ValueError, match=r"rows of 54 bytes \(q4 rows of d_model 96"):
        cpu.sparse_q4_gates(ffn.rows, idx, torch.randn(96))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.sparse_q4_gates(ffn.rows[:, 0, :36].contiguous(), idx, torch.randn(48))
    with pytest.raises(ValueError, match="contiguous bundles"):
        cpu.sparse_q4_gates(ffn.rows.transpose(0, 1).contiguous().transpose(0, 1), idx, x)
    with pytest.raises(ValueError, match="strides"):
        cpu.sparse_q4_gates(ffn.rows[:, 0, :].t().contiguous().t(), idx, x)
    with pytest.raises(ValueError, match=r"x: expected contiguous float32 \[64\], got .*float64"):
        cpu.sparse_q4_gates(ffn.rows, idx, x.double())
    with pytest.raises(ValueError, match="one token"):
        cpu.sparse_q4_gates(ffn.rows, idx, x[None])
    with pytest.raises(ValueError, match="idx: expected contiguous int32"):
        cpu.sparse_q4_gates(ffn.rows, idx.long(), x)
    with pytest.raises(ValueError, match="out: expected contiguous float32 \\[2\\]"):
        cpu.sparse_q4_gates(ffn.rows, idx, x, torch.empty(3))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.sparse_q4_gates(ffn.rows, torch.tensor([0, d_ff], dtype=torch.int32), x)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.sparse_q4_gates(ffn.rows, torch.tensor([-1], dtype=torch.int32), x)
    with pytest.raises(IndexError, match=r"expected neuron indices in \[0, 10\)"):
        kernels.gate_dots(x, ffn, torch.tensor([2, 10]))
    with pytest.raises(ValueError, match="gated FFN of q4 rows"):
        kernels.gate_dots(x, random_ffn("relu", d_model, d_ff, seed=0, dtype="q4"), idx)
    with pytest.raises(ValueError, match="gated FFN of q4 rows"):
        kernels.gate_dots(x, random_ffn("reglu", d_model, d_ff, seed=0, dtype="int8"), idx)
    with pytest.raises(ValueError, match="x: expected float32 \\[64\\]"):
        kernels.gate_dots(torch.randn(32), ffn, idx)
    with pytest.raises(ValueError, match="idx: expected int32/int64"):
        kernels.gate_dots(x, ffn, idx.float())
