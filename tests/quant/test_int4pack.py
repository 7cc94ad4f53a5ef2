"""quant.int4pack: torch's int4 layout written from uint8 nibbles, against torch's own conversion
at each CPU capability torch can run at here (a fresh process each: torch reads
ATEN_CPU_CAPABILITY once), and torch's product over the packed weights against the dequantized
matrix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sparseinfer.quant import int4pack

CHILD = r"""
import torch, torch.nn.functional as F
from sparseinfer.quant import int4pack
from sparseinfer.quant.blocks import Q4Blocks
from sparseinfer.quant.linear import Int4Linear

print(torch.backends.cpu.get_cpu_capability(), *int4pack.layout())
g = torch.Generator().manual_seed(1)
# full blocks of 64 and 32 rows, short last blocks of 16, 32 and 48, one block of 16
for n, k in [(176, 64), (80, 96), (96, 32), (16, 64), (4096, 256)]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    assert torch.equal(int4pack.pack(q), int4pack.pack_ref(q)), (n, k)
    b = Q4Blocks(q, torch.rand(n, k // 32, generator=g) / 8 + 0.01,
                 torch.randn(n, k // 32, generator=g))
    lin = Int4Linear.from_blocks(b)
    x = torch.randn(3, k, generator=g)
    # the weights from the blocks themselves: (q - 8) scale + zero, both rounded to bfloat16
    s = b.scale.bfloat16().float().repeat_interleave(32, dim=1)
    z = (b.offset + 8 * b.scale).bfloat16().float().repeat_interleave(32, dim=1)
    want = F.linear(x.bfloat16().float(), (q.float() - 8) * s + z)
    assert torch.allclose(lin(x), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (n, k)
print("ok")
"""


def capabilities() -> list[str]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    caps = ["default"]
    if " avx2" in flags:
        caps.append("avx2")
    if " avx512f" in flags and " avx512bw" in flags and " avx512vl" in flags:
        caps.append("avx512")
    return caps


@pytest.mark.parametrize("cap", capabilities())
def test_pack_is_torchs_layout_at_each_capability(cap):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, kind, rows, ok = proc.stdout.split()
    assert got.lower() == cap and ok == "ok"
    # the layouts torch 2.13 writes (the probe finds them; a torch with another falls back)
    assert (int(kind), int(rows)) == {"avx512": (1, 64), "avx2": (2, 32), "default": (0, 32)}[cap]


def test_unknown_layout_falls_back_to_torch(monkeypatch):
    """A torch whose conversion matches none of LAYOUTS: its own conversion runs."""
    calls = []

    def other(q):  # a layout nobody knows: the plain one with the nibbles swapped
        calls.append(q.shape)
        return (q[0::2] << 4 | q[1::2]).reshape(q.shape[0], -1) if q.shape[0] % 2 == 0 else None

    monkeypatch.setattr(int4pack, "pack_ref", other)
    int4pack.layout.cache_clear()
    try:
        assert int4pack.layout() is None
        q = torch.randint(0, 16, (32, 8), dtype=torch.uint8)
        calls.clear()
        assert torch.equal(int4pack.pack(q), other(q)) and calls
    finally:
        int4pack.layout.cache_clear()


def test_pack_checks_its_input():
    with pytest.raises(ValueError, match=r"q: expected uint8 \[N, K\] nibbles with K even"):
        int4pack.pack(torch.zeros(16, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="K even"):
        int4pack.pack(torch.zeros(16, 7, dtype=torch.uint8))
