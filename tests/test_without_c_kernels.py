"""Without the C library — another CPU architecture, an x86 CPU without AVX2, or
``SPARSEINFER_C_KERNELS=0`` — models load and run on torch's and numba's kernels. The model
checks run in a fresh process with the library switched off, so a path that still reached for it
fails there; their logits are compared with transformers' here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparseinfer.cpu.ops import OFF_SWITCH
from sparseinfer.threads import default_threads

IDS = [5, 17, 42, 99, 123, 7, 250, 31, 64, 300, 12, 77]
OFF = {**os.environ, OFF_SWITCH: "0"}

# Runs in the child: for each case (name, path, dtype, load options) the decode logits token by
# token, the prompt's logits in one call, and a batched step of three sequences against each
# sequence's own last decode step; or the error a load raised.
CHILD = r"""
import json, logging, sys, torch
logging.basicConfig()
from sparseinfer import cpu
from sparseinfer.fused.decode import attend_rows
from sparseinfer.models.batch import decode_step, slot_cache
from sparseinfer.models.build import load

assert not cpu.loads()
cases, ids, out_path = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

def decode(lm, ids, cache=None):
    cache = cache or lm.model.new_cache(1, len(ids) + 1)
    return torch.stack([lm.model(torch.tensor([[t]]), i, cache)[0, -1] for i, t in enumerate(ids)])

out = {}
for name, path, dtype, opts in cases:
    try:
        lm = load(path, dtype, fused=True, **opts)
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
        continue
    with torch.inference_mode():
        dec = decode(lm, ids)
        pre = lm.model(torch.tensor([ids]), 0, lm.model.new_cache(1, len(ids) + 1))[0]
        seqs = [ids[:4], ids[3:9], ids[6:9]]
        alone = torch.stack([decode(lm, s)[-1] for s in seqs])
        cache = lm.model.new_cache(len(seqs), 16)
        for j, s in enumerate(seqs):
            decode(lm, s[:-1], slot_cache(cache, j))
        rows = decode_step(lm.model, torch.tensor([s[-1] for s in seqs]),
                           torch.tensor([len(s) - 1 for s in seqs]), cache,
                           torch.arange(len(seqs)), attend_rows if lm.plan.fused_decode else None)
    sp = lm.plan.sparse
    pred = getattr(getattr(lm.model.layers[0].ffn, "selector", None), "predictor", None)
    out[name] = {"decode": dec, "prefill": pre, "alone": alone, "rows": rows,
                 "fused": lm.plan.fused_decode, "kv": lm.plan.kv_dtype,
                 "storage": sorted({w.storage for w in lm.plan.weights}),
                 "rows_dtype": sp.ffn_dtype if sp else None,
                 "predictor_dtype": str(pred.fc1.dtype) if pred is not None else None}
torch.save(out, out_path)
"""


def run_child(tmp_path, cases):
    out = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases), json.dumps(IDS),
                           str(out)], env=OFF, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"switched off ({OFF_SWITCH}=0)") == 1  # the warning, once
    return torch.load(out)


def transformers_logits(path) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def close(a, b, tol):
    return float((a - b).abs().max() / b.abs().max()) < tol


def test_switched_off_library_is_said_and_not_loaded():
    code = ("from sparseinfer import cpu; print(cpu.loads()); print(cpu.kernels_in_use())")
    proc = subprocess.run([sys.executable, "-c", code], env=OFF, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    loads, line = proc.stdout.splitlines()
    assert loads == "False"
    assert line.startswith("torch's and numba's") and f"{OFF_SWITCH}=0" in line


@pytest.mark.slow
def test_dense_models_match_transformers(tmp_path, tiny_model_dir, arch_model_dir):
    """A llama block decodes on numba's fused kernels (float32 cache), a Gemma 3 block (which
    only the C block fuses) on the torch modules; both equal transformers."""
    paths = {"llama": tiny_model_dir("swiglu"), "reglu": tiny_model_dir("reglu"),
             "gemma3": arch_model_dir("gemma3")}
    got = run_child(tmp_path, [[n, str(p), "fp32", {}] for n, p in paths.items()]
                    + [["llama-kv16", str(paths["llama"]), "fp32", {"kv_type": "fp16"}]])
    for name, path in paths.items():
        r, want = got[name], transformers_logits(path)
        assert "error" not in r, r
        assert r["fused"] == (name != "gemma3") and r["kv"] == "fp32"
        assert r["storage"] == ["fp32"]
        assert close(r["decode"], want, 1e-4) and close(r["prefill"], want, 1e-4), name
        # a batched step's rows are the sequences' lone steps
        assert close(r["rows"], r["alone"], 1e-5), name
    # a float16 cache asked for: only the C attention reads one in the fused decode, so the
    # torch modules run the blocks
    r = got["llama-kv16"]
    assert "error" not in r, r
    assert not r["fused"] and r["kv"] == "fp16"
    assert close(r["decode"], transformers_logits(paths["llama"]), 1e-2)


@pytest.mark.slow
def test_sparse_models_without_the_library(tmp_path, tiny_model_dir, with_predictors):
    """Sparse FFNs on numba's rows: every neuron (int8 or fp32 rows) and the oracle's
    exact ReLU set equal the dense model (transformers); a batched step's rows, predicted sets
    too, equal the lone steps; q4 rows, which only the C kernels compute, are refused with what
    to ask for instead."""
    path = tiny_model_dir("reglu")
    sparse = str(with_predictors(path))
    sparse16 = str(with_predictors(path, dtype=np.float16))  # float16 predictors, as convert's
    every = {"threshold": -float("inf")}
    got = run_child(tmp_path, [
        ["all-int8", sparse, "auto", {**every, "ffn_dtype": "int8"}],
        ["all-fp32", sparse, "fp32", every],
        ["oracle", sparse, "fp32", {"mode": "oracle"}],
        ["predicted", sparse16, "auto", {"ffn_dtype": "int8"}],
        ["q4", sparse, "auto", {"ffn_dtype": "q4"}],
    ])
    want = transformers_logits(path)
    assert got["all-int8"]["rows_dtype"] == "int8"
    assert close(got["all-int8"]["decode"], want, 3e-2)  # int8 rows (as tests/sparse)
    for name in ("all-fp32", "oracle"):
        assert close(got[name]["decode"], want, 1e-4), name
        assert close(got[name]["prefill"], want, 1e-4), name
    # a batched step's rows are the lone steps: each row its own set (numba's kernel takes the
    # rows' masks over the union)
    for name in ("all-int8", "all-fp32", "oracle", "predicted"):
        assert close(got[name]["rows"], got[name]["alone"], 1e-4), name
    assert got["predicted"]["predictor_dtype"] == "torch.float16"
    assert got["predicted"]["decode"].isfinite().all()
    assert "q4 neuron rows (--ffn-dtype q4) run on the C kernels" in got["q4"]["error"]
    assert "expected --ffn-dtype int8, bf16 or fp32" in got["q4"]["error"]


def test_float16_predictors_select_without_the_library(monkeypatch):
    """A file's float16 predictor without the C library: float32 copies of its weights on
    numba's kernel, the set torch's product gives (within rounding of a threshold)."""
    from sparseinfer import cpu
    from sparseinfer.sparse.ffn import Predicted, Predictor

    g = torch.Generator().manual_seed(0)
    d, f, r = 64, 300, 16
    pred = Predictor((torch.randn(r, d, generator=g) / d**0.5).half(),
                     (torch.randn(f, r, generator=g) / r**0.5).half(), threshold=0.1,
                     bias=0.1 * torch.randn(f, generator=g))
    monkeypatch.setattr(cpu, "_LOADS", False)
    sel = Predicted(pred)
    assert sel._c is None and sel._fc[0].dtype == torch.float32

    class Rows:  # what ``active`` reads of its FFN: the index buffer
        _idx = torch.empty(f, dtype=torch.int32)

    for _ in range(5):
        x = torch.randn(d, generator=g)
        got = set(sel.active(Rows, x).tolist())
        z = pred.fc2.double() @ torch.relu(pred.fc1.double() @ x.double()) + pred.bias.double()
        want = set(torch.nonzero(z >= pred.threshold).reshape(-1).tolist())
        assert 0 < len(want) < f
        margin = (z - pred.threshold).abs()
        assert all(margin[i] < 1e-5 for i in got ^ want)


@pytest.mark.slow
def test_cli_runs_without_the_library(tiny_model_dir):
    """`sparseinfer run` (sampling: top-k in numpy instead of the C sampler) and `info` as a
    user on such a machine sees them."""
    path = str(tiny_model_dir("swiglu"))
    cmd = [sys.executable, "-m", "sparseinfer"]
    run = subprocess.run([*cmd, "run", "-m", path, "-p", "hello", "-n", "6", "--temp", "0.8",
                          "--seed", "1", "--ignore-eos"], env=OFF, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "5 runs" in run.stderr, run.stderr  # llama.cpp's count: the tokens after the first
    if default_threads() > 1:  # the tiny model: one thread by default, said
        assert "threads: 1 (a model this small runs faster on one" in run.stderr
    info = subprocess.run([*cmd, "info", "-m", path], env=OFF, capture_output=True, text=True,
                          timeout=300)
    assert info.returncode == 0, info.stderr
    assert f"kernels: torch's and numba's, not the C library's: the C kernels are switched off " \
           f"({OFF_SWITCH}=0)" in info.stdout
    if default_threads() > 1:  # the tiny model: one thread by default, said
        assert "threads: 1 by default (a model this small" in info.stdout


def test_another_architecture_is_named(monkeypatch):
    """On an ARM machine the build and the load say why, not "run ./install.sh"."""
    import platform

    from sparseinfer.cpu import build, ops

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    want = "the C kernels are x86-64 code, this CPU is aarch64"
    with pytest.raises(build.BuildError, match=want):
        build.build()
    with pytest.raises(ops.CpuLibraryError, match=want):
        ops._load()


THREADS_CHILD = r"""
import sys, threading, torch, numba
from sparseinfer.config import SamplingParams
from sparseinfer.engine import Engine

n = None if sys.argv[2] == "default" else int(sys.argv[2])
e = Engine.load(sys.argv[1], threads=n)

def decode():
    for _ in e.stream(e.encode("hello there"), SamplingParams(max_tokens=4, temperature=0)):
        pass
    return torch.get_num_threads(), numba.get_num_threads()

seen = [decode()]
t = threading.Thread(target=lambda: seen.append(decode()))  # as a server's batch loop
t.start()
t.join()
print(seen)
"""


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), "default"])
def test_threads_asked_are_the_threads_used(tiny_model_dir, n):
    """`-t n` without the C library: torch's and numba's counts stay n on the thread that loaded
    the model and on another one that decodes (numba's pool, starting, set the shared OpenMP
    runtime's count to every core: -t 1 ran torch on two threads). No `-t`: one thread for a
    model this small (``threads.small_model_threads``)."""
    path = str(tiny_model_dir("swiglu"))
    proc = subprocess.run([sys.executable, "-c", THREADS_CHILD, path, str(n)], env=OFF,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = 1 if n == "default" else n
    assert proc.stdout.strip() == str([(want, want), (want, want)])


def test_small_models_take_one_thread_only_without_the_library(monkeypatch):
    """The default thread count is left alone with the C library, for a model whose token reads
    ONE_THREAD_BELOW bytes or more, and on one core; embeddings read by rows do not count."""
    from types import SimpleNamespace

    from sparseinfer import threads

    def plan(*weights):
        return SimpleNamespace(weights=[SimpleNamespace(storage=s, nbytes=b) for s, b in weights])

    small = plan(("file", 10 * threads.ONE_THREAD_BELOW), ("q4", threads.ONE_THREAD_BELOW - 1))
    large = plan(("q4", threads.ONE_THREAD_BELOW // 2), ("int8", threads.ONE_THREAD_BELOW // 2))
    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    monkeypatch.setattr("sparseinfer.cpu._LOADS", False)
    assert threads.small_model_threads(small) == 1
    assert threads.small_model_threads(large) is None
    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    assert threads.small_model_threads(small) is None
    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    monkeypatch.setattr("sparseinfer.cpu._LOADS", True)
    assert threads.small_model_threads(small) is None
