"""``DenseCopy`` (a sparse FFN's dense matrices for several rows at once) against the dense FFN in
float64 from gguf-py's dequantization of the same blocks: gated and plain kinds, with and
without an up bias (x rounded to int8 per 32 by the C products: within that rounding)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sparseinfer.config import FFN_KINDS
from sparseinfer.quant.linear import GGMLLinear
from sparseinfer.sparse.ffn import DenseCopy
from sparseinfer.sparse.reference import ACTS

D, F, N = 64, 96, 5


def blocks(type_name: str, rows: int, cols: int, rng) -> tuple[tuple, torch.Tensor]:
    """A random matrix as ``type_name`` blocks (``GGMLLinear.fill``'s part), and gguf-py's
    float64 reading of them."""
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return ((type_name, raw, rows),
            torch.from_numpy(np.asarray(back, dtype=np.float64)).reshape(rows, cols))


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "reglu", "drelu", "relu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_copy_is_the_dense_ffn(kind, bias):
    k = FFN_KINDS[kind]
    rng = np.random.default_rng(len(kind) + bias)
    mats = [blocks("Q4_0", F, D, rng)] + ([blocks("Q8_0", F, D, rng)] if k.gated else [])
    down, down_f = blocks("Q8_0", D, F, rng)
    up_bias = torch.from_numpy(rng.standard_normal(F).astype(np.float32)) if bias else None
    w_in_bias = None
    if up_bias is not None:
        w_in_bias = torch.cat([torch.zeros(F), up_bias]) if k.gated else up_bias
    w_in, down_lin = GGMLLinear(D, len(mats) * F, bias), GGMLLinear(F, D)
    w_in.fill([part for part, _ in mats], w_in_bias)
    down_lin.fill([down])
    copy = DenseCopy(w_in, down_lin)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    xd = x.double()
    if k.gated:
        g, u = (xd @ w.t() for _, w in mats)
        h = ACTS[k.gate_act](g) * ACTS[k.up_act](u + (up_bias.double() if bias else 0))
    else:
        h = ACTS[k.up_act](xd @ mats[0][1].t() + (up_bias.double() if bias else 0))
    want = h @ down_f.t()
    got = copy(x, k)
    assert got.shape == (N, D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2 * want.abs().max().item())
    assert not torch.allclose(got.double(), want, rtol=0, atol=1e-6)  # (x was rounded: not exact)
