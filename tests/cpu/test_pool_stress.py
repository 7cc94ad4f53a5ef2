"""The pool under many back-to-back jobs of different sizes (two threads): every job finishes and
computes what the reference computes. A worker still leaving one job while the next is published
used to claim a chunk of the new job, and the caller then waited forever (found at 7B shape in
benchmarks/relu_7b.py); this runs in a child process so a hang fails instead of blocking."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import torch
    from sparseinfer import cpu
    from sparseinfer.cpu import reference as ref
    from gguf import GGMLQuantizationType, quants
    import numpy as np

    cpu.set_threads(2)
    rng = np.random.default_rng(0)
    mats, xs, want = [], [], []
    for rows in (32, 4096, 96, 11008 // 4):
        w = rng.standard_normal((rows, 256)).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
        m = cpu.QuantMatrix("Q4_0", raw, rows, 256)
        x = torch.randn(256)
        mats.append(m); xs.append(x)
        out = torch.empty(rows)
        cpu.gemv([m], x, [out])
        want.append(out.clone())
    fc1 = (torch.randn(32, 256) / 16).half()
    fc2 = (torch.randn(2000, 32) / 6).half()
    pred = cpu.F16Predictor(fc1, fc2, torch.zeros(2000))
    idx = torch.empty(2000, dtype=torch.int32)
    k0 = cpu.predict_f16(pred, xs[0], idx)
    outs = [torch.empty(w.shape[0]) for w in want]
    for i in range(20000):
        j = i % 4
        cpu.gemv([mats[j]], xs[j], [outs[j]])
        assert torch.equal(outs[j], want[j]), (i, j)
        if i % 7 == 0:
            assert cpu.predict_f16(pred, xs[0], idx) == k0
    print("ok")
""")


@pytest.mark.slow
def test_many_jobs_of_different_sizes_all_finish():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
