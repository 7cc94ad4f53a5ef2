"""cpu.bundle_rows: a sparse model's neuron rows made from the file's Q4_0 or F16 matrix in C,
against sparse/packed.py's torch quantizers on the float weights (gguf-py dequantizes Q4_0), bit
for bit: q4 rows and int8 (block 32) output, rows and transposed columns, strided outputs, ties;
Q4_0 rows into q4 rows keep gguf-py's numbers exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.sparse.packed import dequantize_q4_rows, q4_rows, quantize_int8, quantize_q4_rows

gguf = pytest.importorskip("gguf")


def q4_0_matrix(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: d = 0
    w[1, 4:32] = 0.25  # a block of equal weights
    w[2:34, 5] = w[2:34, 5] * 1e3  # a column of outliers (transposed: a block of them)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    # column 0 of rows 2 and 3: -8 and +8 (d = 1 and -1, q = 0): tied magnitudes of opposite
    # signs in one block of the transposed rows, the first sets the sign of its scale
    for r, d in ((2, 1.0), (3, -1.0)):
        raw[r, :2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        raw[r, 2] &= 0xF0
    return raw


@pytest.mark.parametrize("src", ["Q4_0", "F16"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("out_dtype", ["q4", "int8"])
@pytest.mark.parametrize("rows,cols", [(64, 96), (96, 64), (32, 32)])
def test_bundle_rows_equal_torch_quantizers(rows, cols, transpose, out_dtype, src, threads):
    rng = np.random.default_rng(rows * cols)
    if src == "Q4_0":
        raw = q4_0_matrix(rows, cols, rng)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).copy())
    else:
        raw = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
        raw[0, :32] = 0.0
        raw[1, :2] = [0.5, -0.5]  # tied magnitudes: the first sets the sign of the Q4_0 scale
        w = torch.from_numpy(raw.astype(np.float32))
    w = w.reshape(rows, cols)
    if transpose:
        w = w.t()
    n, length = w.shape
    # a strided view, as PackedFFN.rows[:, m] of [n, 3, width]
    if out_dtype == "q4":
        store = torch.full((n, 3, length // 32 * 18), 7, dtype=torch.uint8)
        cpu.bundle_rows(raw, src, rows, cols, transpose, store[:, 1])
        if src == "Q4_0" and not transpose:  # the file's numbers, moved: no second rounding
            assert torch.equal(store[:, 1], q4_rows(torch.from_numpy(raw.reshape(n, -1))))
            assert torch.equal(dequantize_q4_rows(store[:, 1]), w)
        else:
            assert torch.equal(store[:, 1], quantize_q4_rows(w))
    else:
        store = torch.full((n, 3, length), 7, dtype=torch.int8)
        sc = torch.full((n, 3, length // 32), -1.0)
        cpu.bundle_rows(raw, src, rows, cols, transpose, store[:, 1], sc[:, 1])
        q, s = quantize_int8(w, 32)
        assert torch.equal(store[:, 1], q) and torch.equal(sc[:, 1], s)
    # the neighbours in the bundle are untouched
    assert (store[:, 0] == 7).all() and (store[:, 2] == 7).all()


def test_bundle_rows_rejects_bad_input():
    raw = np.zeros(4 * 2 * 18, dtype=np.uint8)
    out = torch.empty(64, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu.bundle_rows(raw, "Q4_0", 4, 64, True, out)
    with pytest.raises(ValueError, match="expected out"):
        cpu.bundle_rows(raw, "Q4_0", 4, 64, False, torch.empty(4, 35, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        cpu.bundle_rows(raw, "Q4_0", 4, 64, False, torch.empty(4, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="Q4_0 or F16"):
        cpu.bundle_rows(raw, "Q8_0", 4, 64, False, out)


class _Tensor:
    """What models/build.py's _packed_ffn reads of a file tensor."""

    def __init__(self, name, kind, raw, w):
        self.name, self.kind, self.shape, self._raw, self._w = name, kind, tuple(w.shape), raw, w

    def raw(self):
        return self._raw

    def float(self):
        return self._w.clone()

    def release(self):
        pass


@pytest.mark.parametrize("dtype", ["q4", "int8"])
@pytest.mark.parametrize("down", ["Q4_0", "F16 down_t"])
def test_loader_rows_equal_the_quantized_float_weights(dtype, down, monkeypatch):
    """The loader's bundles (build._packed_ffn) from Q4_0 gate/up and a Q4_0 down (transposed)
    or a converted file's F16 down_t, made in C: each matrix as the torch quantizer makes it from
    the float weights (q4 gate/up: the file's own numbers, moved into q4 rows)."""
    from types import SimpleNamespace

    from sparseinfer.cpu import ops
    from sparseinfer.models.build import _packed_ffn

    calls = []
    real = ops.bundle_rows
    monkeypatch.setattr(ops, "bundle_rows", lambda *a: calls.append(a[1]) or real(*a))

    D, F = 64, 96
    rng = np.random.default_rng(1)
    ts = {}
    for m in ("gate", "up"):
        raw = q4_0_matrix(F, D, rng)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).copy())
        ts[f"layers.0.ffn.{m}.weight"] = _Tensor(m, "Q4_0", raw, w.reshape(F, D))
    if down == "Q4_0":
        raw = q4_0_matrix(D, F, rng)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).copy())
        name, rows_w = "layers.0.ffn.down.weight", w.reshape(D, F)
        ts[name] = _Tensor("down", "Q4_0", raw, rows_w)
        down_rows = rows_w.t()
    else:
        raw = (rng.standard_normal((F, D)) * 0.05).astype(np.float16)
        name, down_rows = "layers.0.ffn.down_t.weight", torch.from_numpy(raw.astype(np.float32))
        ts[name] = _Tensor("down_t", "F16", raw, down_rows)
    src = SimpleNamespace(config=SimpleNamespace(d_model=D, d_ff=F), tensors=ts, path="test")
    names = ("layers.0.ffn.gate.weight", "layers.0.ffn.up.weight", name)
    packed = _packed_ffn(src, names, "swiglu", dtype, None)
    assert calls == ["Q4_0", "Q4_0", down.split()[0]]
    want = [ts[n].float() for n in names[:2]] + [down_rows]
    for m, w in enumerate(want):
        if dtype == "q4" and m < 2:
            raw = torch.from_numpy(ts[names[m]].raw().reshape(F, -1))
            assert torch.equal(packed.rows[:, m], q4_rows(raw))
            assert torch.equal(dequantize_q4_rows(packed.rows[:, m]), w)
        elif dtype == "q4":
            assert torch.equal(packed.rows[:, m], quantize_q4_rows(w))
        else:
            q, s = quantize_int8(w, 32)
            assert torch.equal(packed.rows[:, m], q) and torch.equal(packed.scales[:, m], s)
