"""The load plan and the build-once loader (models/plan.py, models/build.py) on quantized GGUFs
written here with gguf-py (an independent writer): storage decisions, memory checks and their
errors, what runs (``print(model)``), and converted files against their source."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import gguf_parsed_once
from sparseinfer.errors import SparseInferError
from sparseinfer.models.build import load
from sparseinfer.models.loading import open_source
from sparseinfer.models.plan import make_plan
from sparseinfer.quant.linear import FloatLinear, GGMLLinear, Int4Linear, Int8Linear
from sparseinfer.sparse.packed import dequantize_q4_rows, q4_rows

D, F, LAYERS, HEADS, KV = 64, 128, 2, 4, 2


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory, smollm2_path):
    """Factory: ggml type name -> a tiny random llama GGUF whose projections, embedding and
    head are of that type (SmolLM2's tokenizer, so transformers and we read the same ids)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from sparseinfer.offline.export import _copy_fields

    made = {}

    def make(kind: str = "Q4_0"):
        if kind in made:
            return made[kind]
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{kind}.gguf"
        src = gguf.GGUFReader(smollm2_path)
        vocab = len(src.fields["tokenizer.ggml.tokens"].data)
        rng = np.random.default_rng(1)
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_context_length(256)
        w.add_embedding_length(D)
        w.add_block_count(LAYERS)
        w.add_feed_forward_length(F)
        w.add_rope_dimension_count(D // HEADS)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV)
        w.add_layer_norm_rms_eps(1e-5)
        _copy_fields(w, src, lambda k: k.startswith("tokenizer."))

        def mat(rows, cols, scale=0.08):
            a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
            return gguf.quants.quantize(a, Q[kind]), Q[kind]

        def add(name, arr_type):
            arr, t = arr_type
            w.add_tensor(name, arr, raw_dtype=t)

        add("token_embd.weight", mat(vocab, D, 1.0))
        hd = D // HEADS
        for i in range(LAYERS):
            add(f"blk.{i}.attn_norm.weight", (np.ones(D, np.float32), Q.F32))
            add(f"blk.{i}.attn_q.weight", mat(D, D))
            add(f"blk.{i}.attn_k.weight", mat(KV * hd, D))
            add(f"blk.{i}.attn_v.weight", mat(KV * hd, D))
            add(f"blk.{i}.attn_output.weight", mat(D, D))
            add(f"blk.{i}.ffn_norm.weight", (np.ones(D, np.float32), Q.F32))
            add(f"blk.{i}.ffn_gate.weight", mat(F, D))
            add(f"blk.{i}.ffn_up.weight", mat(F, D))
            add(f"blk.{i}.ffn_down.weight", mat(D, F))
        add("output_norm.weight", (np.ones(D, np.float32), Q.F32))
        add("output.weight", mat(vocab, D))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        made[kind] = path
        return path

    return make


IDS = [1, 504, 2113, 314, 253, 6121, 30, 975, 12, 44]


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(torch.tensor([ids]), 0, model.new_cache(1, len(ids)))[0]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["Q4_1", pytest.param("Q4_0", marks=pytest.mark.slow), "BF16"])
def test_float_rows_of_4_bit_tensors_equal_gguf_py(quant_gguf, smollm2_path, kind):
    """FileTensor.float (what --dtype fp32 and the profile load read) decodes Q4_0/Q4_1 blocks
    with torch's ops, and BF16 by a shift: the values gguf-py's dequantize gives, for whole
    tensors and row ranges (Q4_1: SmolLM2's own first layers)."""
    from gguf import GGMLQuantizationType, quants

    src = open_source(smollm2_path if kind == "Q4_1" else quant_gguf(kind))
    mats = [t for name, t in src.tensors.items()
            if name.startswith(("layers.0.", "layers.1.")) and t.kind == kind]
    assert mats
    for t in mats:
        want = quants.dequantize(np.asarray(t.raw()), GGMLQuantizationType[kind]).reshape(t.shape)
        got = t.float()
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(t.shape)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(t.float(1, 3).numpy(), want[1:3])


@pytest.mark.slow
def test_q4_0_file_stays_as_stored(quant_gguf):
    """--dtype auto: every projection and the head keep the file's Q4_0 blocks (C kernels; in
    16-row panels, the same bytes), the embedding stays in the map; the plan's bytes stay
    within the file size; print(model) shows exactly those modules, and they multiply by
    gguf-py's weights."""
    from gguf import GGMLQuantizationType, quants

    path = quant_gguf("Q4_0")
    plan = make_plan(open_source(path), "auto")
    storage = {(w.storage, w.origin) for w in plan.weights if w.module != "tok_emb"}
    assert storage == {("ggml", "file blocks")}
    assert plan.weight("tok_emb").storage == "file"
    assert plan.nbytes <= path.stat().st_size
    lm = load(path, "auto", fused=True)
    text = str(lm.model)
    assert "GGMLLinear" in text and "FileEmbedding" in text and "Q4_0 in 16-row panels" in text
    assert "FloatLinear" not in text and "Int4Linear" not in text
    head = lm.model.lm_head
    assert isinstance(head, GGMLLinear)
    t = lm.source.tensors["lm_head.weight"]
    want = quants.dequantize(np.asarray(t.raw()), GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(head.dequantized().numpy(), want.reshape(t.shape))
    assert head.mats[0].type_name == "Q4_0x16"  # the rearranged copy (cpu/panels.py)


@pytest.mark.slow
def test_without_the_c_kernels_4_bit_files_use_torchs_int4(quant_gguf, monkeypatch):
    import sparseinfer.models.plan as plan_mod

    monkeypatch.setattr(plan_mod, "cpu_loads", lambda: False)
    path = quant_gguf("Q4_0")
    plan = make_plan(open_source(path), "auto")
    layer_storage = {(w.storage, w.origin) for w in plan.weights if w.module.startswith("layers.")}
    assert layer_storage == {("q4", "file blocks")}
    assert plan.weight("lm_head").storage == "int8"
    assert plan.nbytes <= 1.15 * path.stat().st_size
    lm = load(path, "auto")
    assert isinstance(lm.model.layers[0].attn.wqkv, Int4Linear)
    assert isinstance(lm.model.lm_head, Int8Linear)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_file_logits_against_transformers(quant_gguf, kind):
    """Our fp32 load equals transformers' dequantizing GGUF load; the default (file's own
    storage: 4-bit blocks or int8, bfloat16 activations) stays close to it."""
    import transformers as tf

    path = quant_gguf(kind)
    with gguf_parsed_once():
        hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    fp32 = load(path, "fp32")
    assert _rel(_logits(fp32.model), want) < 1e-4
    # q4 re-rounds a Q8_0 file to 4 bits: looser there
    for dtype, storage, tol in (("auto", "ggml", 0.05), ("q4", "q4", 0.05 if "Q4" in kind else 0.15)):
        lm = load(path, dtype)
        assert lm.plan.weight("layers.0.attn.wqkv").storage == storage
        assert _rel(_logits(lm.model), want) < tol
        if tol < 0.1:  # kept at the file's precision: greedy choices agree
            assert (_logits(lm.model).argmax(-1) == want.argmax(-1)).float().mean() > 0.8


@pytest.mark.slow
def test_memory_check_before_anything_is_allocated(quant_gguf, monkeypatch):
    import sparseinfer.models.plan as plan_mod

    monkeypatch.setattr(plan_mod, "available_memory", lambda: 1000)
    with pytest.raises(SparseInferError, match=r"needs 0\.\d+ GiB .*KV cache.* but 0\.00 GiB is "
                                                r"available"):
        load(quant_gguf("Q4_0"), "auto")


@pytest.mark.slow
def test_out_of_memory_while_filling_is_not_called_corrupt(quant_gguf, monkeypatch, capsys):
    from sparseinfer.cli import main
    from sparseinfer.models.loading import FileTensor

    def boom(self, *a, **k):
        raise MemoryError("Unable to allocate 688. KiB")

    monkeypatch.setattr(FileTensor, "float", boom)
    assert main(["run", "-m", str(quant_gguf("Q4_0")), "-p", "Hello", "-n", "2",
                 "--dtype", "fp32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "out of memory" in err
    assert "corrupt" not in err and "truncated" not in err


@pytest.mark.slow
def test_bf16_plan_and_float_storage(quant_gguf):
    lm = load(quant_gguf("Q4_0"), "bf16")
    assert lm.model.dtype == torch.bfloat16 and not lm.plan.fused_decode
    lin = lm.model.layers[0].attn.wqkv
    assert isinstance(lin, FloatLinear) and lin.weight.dtype == torch.bfloat16


FAST = ["--max-tokens", "512", "--chunk-len", "64", "--ranks", "4", "--epochs", "2", "-t", "1"]


@pytest.fixture(scope="module")
def converted(quant_gguf, tmp_path_factory):
    """The Q4_0 tiny model converted (profile, predictors, export) with default options, and
    with the gate score."""
    from sparseinfer.cli import main

    out = {}
    for score in ("output", "gate"):
        path = tmp_path_factory.mktemp("conv") / f"tiny.{score}.sparse.gguf"
        assert main(["convert", "-m", str(quant_gguf("Q4_0")), "-o", str(path), "--score", score,
                     *FAST]) == 0
        out[score] = path
    return out


@pytest.mark.slow
def test_converted_file_gives_the_sources_default_logits(quant_gguf, converted):
    """A converted file under default flags with every neuron active (and with --dense) gives
    the source's default logits: nothing the source kept exact is rounded to fewer bits again
    (its 4-bit blocks are copied, rows permuted; the transposed down projection is stored as F32
    and its rows default to int8 with a scale per 32 weights, ``--ffn-dtype auto``). 4-bit rows,
    asked for, round the down projection again: close, not equal."""
    from sparseinfer.engine import Engine

    source = Engine.load(quant_gguf("Q4_0"), n_ctx=64)
    want = _logits(source.model)
    # (asked for, what runs, tolerance): int8 rows round to 8 bits per 32 weights, bf16 to 8
    # bits of mantissa; on this random model int8's logits sit a little further off
    for ffn_dtype, runs, tol in (("auto", "int8", 2e-2), ("bf16", "bf16", 1e-2),
                                 ("fp32", "fp32", 1e-2)):
        sparse = Engine.load(converted["output"], n_ctx=64, threshold=-float("inf"),
                             ffn_dtype=ffn_dtype, batch_ffn="sparse")  # (the prompt: its rows)
        assert sparse.sparse_info.ffn_dtype == runs
        got = _logits(sparse.model)
        assert sparse.sparse_info.density() == 1.0
        assert _rel(got, want) < tol, ffn_dtype
    dense = Engine.load(converted["output"], n_ctx=64, dense=True)
    assert {w.origin for w in dense.loaded.plan.weights if "ffn.down" in w.module} == {"as stored"}
    assert _rel(_logits(dense.model), want) < 1e-2
    q4 = Engine.load(converted["output"], n_ctx=64, threshold=-float("inf"), ffn_dtype="q4",
                     batch_ffn="sparse")
    assert _rel(_logits(q4.model), want) < 5e-2


@pytest.mark.slow
def test_batch_ffn_plans_a_dense_copy(converted):
    """--batch-ffn: "dense" holds a dense copy of every sparse FFN beside its bundles (the
    file's Q4_0 gate/up bytes, down_t as Q8_0: counted in the plan), "sparse" none, "auto" one
    where the file's predictors select half the neurons or more (their density as gguf-py reads
    it); a copy where the C block cannot take it is an error naming the reason."""
    from gguf import GGUFReader

    path = converted["output"]
    r = GGUFReader(str(path))
    f = r.fields["sparseinfer.predictor.density"]
    density = [float(f.parts[i][0]) for i in f.data]
    plans = {b: make_plan(open_source(path), batch_ffn=b) for b in ("auto", "sparse", "dense")}
    assert [plans[b].sparse.batch_dense for b in ("sparse", "dense")] == [False, True]
    assert plans["auto"].sparse.batch_dense == (np.mean(density) >= 0.5)
    per_layer = sum(int(t.n_bytes) for t in r.tensors
                    if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")))
    assert plans["dense"].nbytes - plans["sparse"].nbytes == per_layer + LAYERS * D * F // 32 * 34
    assert "a dense copy for batches" in plans["dense"].summary()
    for dense_density, want in ((0.9, True), (0.3, False)):  # the rule itself, on this file
        src = open_source(path)
        src.metadata["sparseinfer.predictor.density"] = [dense_density] * LAYERS
        assert make_plan(src, batch_ffn="auto").sparse.batch_dense is want
    with pytest.raises(SparseInferError, match="--batch-ffn dense: .*int8 rows .*here fp32 rows"):
        make_plan(open_source(path), "fp32", batch_ffn="dense")
    with pytest.raises(SparseInferError, match="--batch-ffn dense: .*C kernels are not in use"):
        make_plan(open_source(path), "q4", batch_ffn="dense")
    with pytest.raises(SparseInferError, match="--batch-ffn dense: .*fast tier"):
        make_plan(open_source(path), batch_ffn="dense", split_tiers=True, vram_budget=0.002,
                  min_split=32)  # the CPU standing in for a fast device holding hot neurons
    for mode in ("oracle", "all"):
        with pytest.raises(SparseInferError, match=f"--batch-ffn dense: .*--sparse-mode {mode}"):
            make_plan(open_source(path), mode=mode, batch_ffn="dense")
    # forced tiers without hot neurons are one tier: the copy is taken
    assert make_plan(open_source(path), batch_ffn="dense", split_tiers=True).sparse.batch_dense
    with pytest.raises(SparseInferError, match=r"--batch-ffn: expected one of \['auto'"):
        make_plan(open_source(path), batch_ffn="union")


@pytest.mark.slow
def test_dense_copy_gives_the_sources_dense_numbers(quant_gguf, converted):
    """With a dense copy (--batch-ffn dense) a prompt (the torch path) and a batched decode step
    (the C block) compute every neuron: the source file's logits (gguf-py wrote its Q4_0
    blocks; down rounded to Q8_0 once more: close, not equal), none counted as sparse; one token
    alone stays the sparse FFN (counted); --batch-ffn sparse counts every row's predicted set."""
    from sparseinfer.engine import Engine
    from sparseinfer.fused.decode import attend_rows
    from sparseinfer.models.batch import decode_step

    source = Engine.load(quant_gguf("Q4_0"), n_ctx=64)
    copy = Engine.load(converted["output"], n_ctx=64, batch_ffn="dense")
    sparse = Engine.load(converted["output"], n_ctx=64, batch_ffn="sparse")
    want = _logits(source.model)
    assert _rel(_logits(copy.model), want) < 1e-2
    assert copy.sparse_info.modules[0].stats.tokens == 0
    _logits(sparse.model)  # its prompt tokens: each its predicted set
    assert sparse.sparse_info.modules[0].stats.tokens == len(IDS)

    def step(e):
        toks = torch.tensor(IDS[:3])
        cache = e.model.new_cache(3, 8)
        with torch.inference_mode():
            return decode_step(e.model, toks, torch.zeros(3, dtype=torch.long), cache,
                               torch.arange(3), attend_rows)

    want_rows = step(source)
    assert _rel(step(copy), want_rows) < 1e-2
    assert copy.sparse_info.modules[0].stats.tokens == 0
    sparse.sparse_info.reset_stats()
    step(sparse)
    assert sparse.sparse_info.modules[0].stats.tokens == 3
    with torch.inference_mode():
        copy.model(torch.tensor([IDS[:1]]), 0, copy.model.new_cache(1, 4))
    assert copy.sparse_info.modules[0].stats.tokens == 1  # (the copy's rows are not counted)


@pytest.mark.slow
def test_gate_score_file_loads_and_runs(converted, capsys):
    """A file converted with --score gate loads in every mode (it used to fail with a
    traceback: the runtime accepted only output/output_norm)."""
    from sparseinfer.cli import main

    assert main(["run", "-m", str(converted["gate"]), "-p", "Hello", "-n", "4", "--temp", "0",
                 "--sparse-mode", "oracle"]) == 0
    assert "mode oracle" in capsys.readouterr().err
    assert main(["run", "-m", str(converted["gate"]), "-p", "Hello", "-n", "4",
                 "--temp", "0"]) == 0


@pytest.mark.slow
def test_info_prints_the_plan_without_loading(quant_gguf, capsys, monkeypatch):
    from sparseinfer.cli import main
    from sparseinfer.models import build

    monkeypatch.setattr(build, "fill", lambda *a, **k: pytest.fail("info must not read weights"))
    assert main(["info", "-m", str(quant_gguf("Q4_0"))]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "file blocks" in out and "memory: needs" in out


@pytest.mark.slow
def test_q4_rows_keep_a_q4_0_files_blocks(converted):
    """--ffn-dtype q4 on a file whose gate/up are Q4_0: the bundled rows are the file's own
    blocks' bytes (no second rounding) in the q4 rows' layout, the same numbers as gguf-py
    reads from the file; the transposed down projection (F32 in the sparse file) is quantized
    once."""

    lm = load(converted["output"], "auto", ffn_dtype="q4", threshold=-float("inf"))
    ffn = lm.model.layers[1].ffn
    assert ffn.packed.dtype == "q4"
    for m, name in enumerate(("blk.1.ffn_gate.weight", "blk.1.ffn_up.weight")):
        raw = np.asarray(lm.source.tensors[lm.source.tensors and
                                           f"layers.1.ffn.{('gate', 'up')[m]}.weight"].raw())
        assert lm.source.tensors[f"layers.1.ffn.{('gate', 'up')[m]}.weight"].name == name
        rows = ffn.packed.rows[:, m]
        assert torch.equal(rows, q4_rows(torch.from_numpy(raw.reshape(F, -1).copy())))
        want = gguf.quants.dequantize(raw.reshape(F, -1), gguf.GGMLQuantizationType.Q4_0)
        np.testing.assert_array_equal(dequantize_q4_rows(rows).numpy(), want.reshape(F, -1))
    want = _logits(load(converted["output"], "auto", threshold=-float("inf")).model)
    assert _rel(_logits(lm.model), want) < 0.1  # the down projection rounded to 4 bits


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_kv_cache_type(quant_gguf, converted, which):
    """``--cache-type``: auto holds keys and values in float16 (half the bytes per token) where
    the default weights decode through the fused kernels (the C block, or a sparse FFN's block
    with ``cpu.attend_token``), fp32 where asked or where the weights are fp32 by request.
    Prompt and decoded logits with the float16 cache stay close to the float32 cache's (seen:
    7e-3 of the largest logit on the dense random model; each product rounds its input to int8,
    which a float16 key can tip)."""
    path = quant_gguf("Q4_0") if which == "dense" else converted["output"]
    src = open_source(path)
    auto, f32 = make_plan(src, "auto"), make_plan(src, "auto", kv_type="fp32")
    assert (auto.kv_dtype, f32.kv_dtype) == ("fp16", "fp32")
    assert 2 * auto.kv_bytes_per_token == f32.kv_bytes_per_token == 2 * LAYERS * KV * (D // HEADS) * 4
    assert make_plan(src, "fp32").kv_dtype == "fp32"
    assert make_plan(src, "auto", kv_type="fp16", fused=False).kv_dtype == "fp16"
    with pytest.raises(SparseInferError, match="--cache-type: expected one of"):
        make_plan(src, "auto", kv_type="q8_0")

    from sparseinfer.engine import Engine

    ids = [1, 504, 3158, 282, 260, 1345, 28, 9]
    out = {}
    for kv in ("auto", "fp32"):
        e = Engine.load(path, n_ctx=64, kv_type=kv)
        assert (e.sparse_info is not None) == (which == "sparse")
        cache = e.model.new_cache(1, 32)
        assert cache.k.dtype == (torch.float16 if kv == "auto" else torch.float32)
        with torch.inference_mode():
            prompt = e.model(torch.tensor([ids[:6]]), 0, cache)[0]
            steps = [e.model(torch.tensor([[t]]), 6 + i, cache)[0, -1] for i, t in enumerate(ids[6:])]
        out[kv] = torch.cat([prompt, torch.stack(steps)])
    assert 0 < _rel(out["auto"], out["fp32"]) < 2e-2


def _stepwise_logits(model, ids=IDS):
    """Logits of each position fed one token at a time through the cache (the GEMV path)."""
    cache = model.new_cache(1, len(ids))
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([[t]]), i, cache)[0] for i, t in enumerate(ids)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_16_bit_files_stay_16_bit(quant_gguf, kind):
    """F16 / BF16 projections run on the C kernels' 16-bit rows as the file stores them (not an
    fp32 copy: half the memory and the bytes a token reads); logits as transformers' (which
    dequantizes the file to fp32), for a prompt (GEMM) and token by token (GEMV, fused)."""
    import transformers as tf

    path = quant_gguf(kind)
    plan = make_plan(open_source(path), "auto")
    assert {(w.storage, w.origin) for w in plan.weights if w.module.startswith("layers.")} == \
        {("ggml", "as stored")}
    assert plan.weight("layers.0.ffn.w_in").nbytes == 2 * 2 * F * D
    assert plan.weight("tok_emb").storage == "file"  # rows read from the map on lookup
    with gguf_parsed_once():
        hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    for fused in (False, True):
        lm = load(path, "auto", kv_type="fp32", fused=fused)
        lin = lm.model.layers[0].attn.wqkv
        assert isinstance(lin, GGMLLinear) and {m.type_name for m in lin.mats} == {kind}
        assert lm.plan.fused_decode == fused
        assert _rel(_logits(lm.model), want) < 1e-4
        assert _rel(_stepwise_logits(lm.model), want) < 1e-4


def test_16_bit_without_the_c_kernels_is_fp32(quant_gguf, monkeypatch):
    import sparseinfer.models.plan as plan_mod

    monkeypatch.setattr(plan_mod, "cpu_loads", lambda: False)
    plan = make_plan(open_source(quant_gguf("BF16")), "auto")
    assert plan.weight("layers.0.attn.wqkv").storage == "fp32"


def test_bf16_safetensors_stay_bf16(tmp_path, tiny_model_dir):
    """A Hugging Face model saved in bfloat16 (the usual checkpoint) loads as BF16 rows: the
    safetensors file's bytes, mapped; logits as transformers' float32 load of the same files."""
    import shutil

    import transformers as tf

    d = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir("swiglu"), d)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    plan = make_plan(open_source(d), "auto")
    assert plan.weight("layers.0.attn.wqkv").storage == "ggml"
    assert plan.weight("tok_emb").storage == "file"
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = [1, 5, 9, 3, 7, 2]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    lm = load(d, "auto", kv_type="fp32", fused=True)
    mats = lm.model.layers[1].ffn.w_in.mats
    assert {m.type_name for m in mats} == {"BF16"}
    # the file's own bytes, mapped (not a copy): the same numbers safetensors reads
    from safetensors.torch import load_file

    st = load_file(d / "model.safetensors")
    assert all(not m.raw.flags.writeable and not m.raw.flags.owndata for m in mats)
    want_gate = st["model.layers.1.mlp.gate_proj.weight"]
    assert torch.equal(torch.from_numpy(np.array(mats[0].raw)).view(torch.bfloat16)
                       .reshape(want_gate.shape), want_gate)
    assert _rel(_logits(lm.model, ids), want) < 1e-4
    assert _rel(_stepwise_logits(lm.model, ids), want) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_safetensors_embedding_stays_mapped(tmp_path, tiny_model_dir, dtype):
    """A 16-bit checkpoint's token embedding is read where the file is mapped, a row at a time
    (not widened to float32 at load): each looked-up row equals safetensors' own reading."""
    import shutil

    import transformers as tf
    from safetensors.torch import load_file

    from sparseinfer.models.build import FileEmbedding

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("swiglu"), d)
    tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(dtype).save_pretrained(
        d, safe_serialization=True)
    lm = load(d, "auto")
    assert isinstance(lm.model.tok_emb, FileEmbedding)
    ids = torch.tensor([[0, 7, 3, 7], [lm.config.vocab_size - 1, 2, 1, 5]])
    want = load_file(d / "model.safetensors")["model.embed_tokens.weight"][ids].float()
    assert torch.equal(lm.model.tok_emb(ids), want)

