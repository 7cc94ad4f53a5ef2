"""The disk tier (sparseinfer.disk) on a tiny converted ReGLU model.

Reference: the all-in-RAM sparse model loaded from the *unbundled* file (its own loader path,
q4 rows quantized from the file's tensors); the bundled rows are checked against gguf-py's reading
of the original file. With any RAM split, cache size, eviction policy or prefetch setting the
logits must equal the reference's up to float summation order; a read that fails or comes back
short must raise DiskReadError.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from sparseinfer.cli import main
from sparseinfer.disk.layout import BUNDLE, bundle_file, layout_of, rows_view
from sparseinfer.disk.plan import DiskOptions
from sparseinfer.disk.reader import MAX_RUN, DiskReadError, NeuronReader
from sparseinfer.disk.tier import DiskFFN, disk_report
from sparseinfer.errors import SparseInferError
from sparseinfer.models.build import load
from sparseinfer.models.loading import open_source

FAST = ["--max-tokens", "1024", "--chunk-len", "128", "--ranks", "8", "--epochs", "3", "-t", "1"]
IDS = [5, 17, 99, 3, 42, 7, 8, 100, 11, 250, 31, 64]
PROMPT = 5  # tokens prefilled at once (the batched path), the rest decoded one by one


@pytest.fixture(scope="module")
def sparse_file(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("disk") / "tiny-reglu.sparse.gguf"
    assert main(["convert", "-m", str(tiny_model_dir("reglu")), "-o", str(out), *FAST]) == 0
    return out


@pytest.fixture(scope="module")
def bundled(sparse_file):
    out = {dt: bundle_file(sparse_file, sparse_file.with_name(f"tiny.{dt}.gguf"), dt,
                           gates_apart=False) for dt in ("q4", "fp32")}
    # the rows in another order than the neurons' (as the co-activation order writes them): any
    # order must read and compute the same
    cfg = open_source(sparse_file).config
    rng = np.random.default_rng(7)
    orders = [rng.permutation(cfg.d_ff) for _ in range(cfg.n_layers)]
    out["q4-shuffled"] = bundle_file(sparse_file, sparse_file.with_name("tiny.q4s.gguf"), "q4",
                                     orders, "random", gates_apart=False)
    # the gate rows apart (ReGLU: gates first), in neuron order and shuffled
    out["q4-gates"] = bundle_file(sparse_file, sparse_file.with_name("tiny.q4g.gguf"), "q4")
    out["q4-gates-shuffled"] = bundle_file(sparse_file, sparse_file.with_name("tiny.q4gs.gguf"),
                                           "q4", orders, "random", gates_apart=True)
    return out


def _logits(loaded) -> torch.Tensor:
    m = loaded.model
    cache = m.new_cache(1, 64)
    with torch.no_grad():
        out = [m(torch.tensor([IDS[:PROMPT]]), 0, cache)[0]]
        for i, t in enumerate(IDS[PROMPT:]):
            out.append(m(torch.tensor([[t]]), PROMPT + i, cache)[0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(sparse_file):
    """All neurons in RAM, from the unbundled file, per dtype."""
    return {dt: _logits(load(sparse_file, "auto", ffn_dtype=dt)) for dt in ("q4", "fp32")}


def test_bundles_hold_the_files_rows(sparse_file, bundled):
    """fp32 bundles are the original file's gate, up and down_t rows, byte for byte (read by
    gguf-py); the layout is aligned for O_DIRECT."""
    from gguf import GGUFReader

    orig = {t.name: np.asarray(t.data) for t in GGUFReader(sparse_file).tensors}
    src = open_source(bundled["fp32"])
    lay = layout_of(src)
    assert lay.stride % 512 == 0 and all(o % 512 == 0 for o in lay.offsets)
    assert "layers.0.ffn.gate.weight" not in src.tensors
    for i in range(src.config.n_layers):
        rows = rows_view(src, i, 0, src.config.d_ff)
        for m, name in enumerate(("ffn_gate", "ffn_up", "ffn_down_t")):
            want = orig[f"blk.{i}.{name}.weight"].reshape(src.config.d_ff, -1)
            np.testing.assert_array_equal(rows[:, m], want)
    for name in orig:  # everything else copied
        if not any(k in name for k in ("ffn_gate", "ffn_up", "ffn_down_t")):
            np.testing.assert_array_equal(
                np.asarray(src.reader.get_tensor(
                    [t.name for t in src.reader.tensors].index(name)).data), orig[name])


@pytest.mark.parametrize("kind", ["q4", "q4-shuffled", "q4-gates", "q4-gates-shuffled"])
@pytest.mark.parametrize("gap", [0, 2, 200])
def test_reader_reads_what_the_map_holds(bundled, kind, gap):
    """Any set of neurons, read through runs of file rows (gaps of up to ``gap`` unwanted rows
    read through), comes back as the map holds it, in the order asked; with the gates apart,
    the gate rows and the up/down rows each from their own tensor."""
    src = open_source(bundled[kind])
    lay = layout_of(src)
    plain = layout_of(open_source(bundled["q4"]))
    assert (lay.positions is None) == (kind in ("q4", "q4-gates"))
    assert lay.gates_apart == kind.startswith("q4-gates")
    rng = np.random.default_rng(0)
    for direct in (True, False):
        r = NeuronReader(lay, threads=3, direct=direct, max_gap=gap)
        try:
            for layer in range(src.config.n_layers):
                nn = np.sort(rng.choice(lay.d_ff, 70, replace=False))
                got = np.concatenate([r.read(layer, nn, part) for part in lay.parts], axis=1)
                want = rows_view(src, layer, 0, lay.d_ff)[lay.row_of(layer, nn)].reshape(70, -1)
                np.testing.assert_array_equal(got, want)
                # neuron n's bytes are the neuron-order file's row n, wherever they were written
                src0 = open_source(plain.path)
                np.testing.assert_array_equal(
                    got, rows_view(src0, layer, 0, lay.d_ff)[nn].reshape(70, -1))
            # reads counted by brute force: a read starts at a wanted row and takes the next
            # wanted rows while each is within gap + 1 rows of the last and MAX_RUN of the first
            rr = np.sort(lay.row_of(layer, nn)).tolist()
            n_reads, first = 1, rr[0]
            for prev, row in zip(rr, rr[1:]):
                if row - prev > gap + 1 or row - first >= MAX_RUN:
                    n_reads, first = n_reads + 1, row
            n0 = r.reads
            r.read(layer, nn)  # (the bundle part: with the gates apart, the up/down rows)
            assert r.reads - n0 == n_reads
        finally:
            r.close()


def test_bundle_cli_puts_relu_gates_apart_by_default(sparse_file, tmp_path, reference):
    """``python -m sparseinfer.disk bundle``: the gate rows apart for q4 rows of a ReLU gate
    unless told otherwise; fp32 rows bundled (asked to put them apart, the disk tier reads each
    neuron's two parts: no gates first without the q4 kernel, the same logits)."""
    from sparseinfer.disk.__main__ import main as disk_main

    for args, apart in ((["--gates-apart", "auto"], True), (["--gates-apart", "no"], False),
                        (["--dtype", "fp32"], False), (["--dtype", "fp32", "--gates-apart",
                                                        "yes"], True)):
        out = tmp_path / f"{'-'.join(args)}.gguf"
        assert disk_main(["bundle", str(sparse_file), str(out), *args]) == 0
        lay = layout_of(open_source(out))
        assert lay.gates_apart == apart
        if apart:
            assert lay.gate_stride % 512 == 0 and all(o % 512 == 0 for o in lay.gate_offsets)
    d = load(out, "auto", disk_options=DiskOptions(ram_counts=(10, 0), cache_slots=8))
    assert not d.model.layers[0].ffn.gates_first
    torch.testing.assert_close(_logits(d), reference["fp32"], atol=1e-5, rtol=1e-5)


def test_measured_gap_weighs_a_read_against_its_rows(bundled, monkeypatch):
    """measure_gap: the ratio of a read's own cost to a row's less one, from timed reads of 1
    and of 1 + longest rows (here timed by a stand-in clock that charges what a disk would),
    capped at longest; the default where the page cache would answer (no O_DIRECT) or a
    caller's pread replaces the C reads."""
    import sparseinfer.disk.reader as reader_mod

    lay = layout_of(open_source(bundled["q4"]))
    r = NeuronReader(lay, threads=2, direct=True)
    try:
        if not r.direct:
            pytest.skip("O_DIRECT refused here (tmpfs)")
        assert 0 <= r.measure_gap(seconds=0.02) <= 8
        for per_read, per_row, want in ((30.0, 5.0, 5), (45.0, 10.0, 3), (20.0, 18.0, 0),
                                        (5.0, 30.0, 0), (100.0, 1.0, 8)):
            clock = {"t": 0.0}
            real = r._c

            def timed(fd, start, length, *args, _real=real, _read=per_read, _row=per_row):
                got = _real(fd, start, length, *args)
                clock["t"] += sum(_read + _row * n / lay.stride for n in length.tolist())
                return got

            monkeypatch.setattr(r, "_c", timed)
            monkeypatch.setattr(reader_mod.time, "perf_counter", lambda: clock["t"])
            assert r.measure_gap(seconds=0.02 * 1e6, longest=8) == want
            monkeypatch.undo()
    finally:
        r.close()
    plain = NeuronReader(lay, threads=2, direct=False)
    try:
        assert plain.measure_gap(seconds=0.01) == reader_mod.DEFAULT_GAP
    finally:
        plain.close()
    # a pread of the caller's: the Python reads
    r = NeuronReader(lay, threads=2, pread=lambda fd, bufs, offset: os.preadv(fd, bufs, offset))
    try:
        assert r.measure_gap(seconds=0.01) == reader_mod.DEFAULT_GAP
    finally:
        r.close()


def test_shuffled_bundles_hold_the_files_rows(bundled):
    """The position map says where each neuron's rows went; read through it the shuffled file
    holds the neuron-order file's rows."""
    a, b = open_source(bundled["q4"]), open_source(bundled["q4-shuffled"])
    lay = layout_of(b)
    assert b.metadata["sparseinfer.bundle.order"] == "random"
    assert a.metadata["sparseinfer.bundle.order"] == "neuron"
    for i in range(b.config.n_layers):
        assert sorted(lay.positions[i].tolist()) == list(range(lay.d_ff))
        want = rows_view(a, i, 0, lay.d_ff)
        np.testing.assert_array_equal(rows_view(b, i, 0, lay.d_ff)[lay.positions[i]], want)


def test_bundled_file_all_in_ram_equals_reference(bundled, reference):
    for kind in ("q4", "fp32", "q4-shuffled", "q4-gates", "q4-gates-shuffled"):
        got = _logits(load(bundled[kind], "auto"))
        torch.testing.assert_close(got, reference["fp32" if kind == "fp32" else "q4"],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q4", "q4-shuffled", "q4-gates", "q4-gates-shuffled"])
@pytest.mark.parametrize("eviction", ["lru", pytest.param("freq", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ram,slots,prefetch", [
    ((0, 0), 1, False), pytest.param((0, 0), 3, True, marks=pytest.mark.slow),
    ((20, 5), 8, True), ((100, 192), 50, True),
    pytest.param((30, 0), 192, True, marks=pytest.mark.slow),
    pytest.param((192, 0), 192, False, marks=pytest.mark.slow)])
def test_disk_tier_logits_equal_all_in_ram(bundled, reference, eviction, ram, slots, prefetch,
                                           kind):
    opts = DiskOptions(ram_counts=ram, cache_slots=slots, eviction=eviction, prefetch=prefetch,
                       read_gap=2)  # not measured: any gap reads the same rows (above)
    d = load(bundled[kind], "auto", disk_options=opts)
    ffn = d.model.layers[0].ffn
    assert isinstance(ffn, DiskFFN) and ffn.n_ram == ram[0] and ffn.cache.capacity == slots
    assert ffn.gates_first == kind.startswith("q4-gates")
    # every layer shares one reader and one layout (a position map per layer, not per cache);
    # reading a reordered file's RAM neurons at load is not counted as the run's
    caches = [layer.ffn.cache for layer in d.model.layers]
    assert len({id(c.reader) for c in caches}) == 1
    assert all(c.layout is caches[0].reader.layout for c in caches)
    assert disk_report(d.model).bytes_read == 0
    got = _logits(d)
    # float sums in another order only (larger active sets go in chunks; even when all fit, the
    # bits matched only in some test orders: 1e-6 apart in isolation, at c3f0f0f too)
    torch.testing.assert_close(got, reference["q4"], atol=1e-5, rtol=1e-5)
    rep = disk_report(d.model)
    st = rep.cache
    assert st.requested == st.hits + st.prefetch_hits + st.misses
    if ram != (192, 0):
        assert rep.bytes_read > 0 and st.requested > 0


@pytest.mark.parametrize("kind", ["q4", "q4-gates"])
def test_three_tiers_logits_equal_all_in_ram(sparse_file, bundled, kind):
    """Three tiers, one placement: --vram-budget's hot prefix on the fast device (the CPU
    standing in: ``split_tiers``), the next neurons in RAM, the rest read from the file. The
    logits equal those of the same placement with every other neuron in RAM; per token a layer
    computes what SparseFFN's two tiers compute (the fast tier in torch, the rest in C); the RAM
    budget holds no fast neuron."""
    from sparseinfer.models.plan import make_plan

    src = open_source(bundled[kind])
    fast_opts = dict(device="cpu", split_tiers=True, vram_budget=2.0**-30 * (196_608 + 20_000),
                     min_split=0)  # (the tiny model's embeddings and attention: 196,608 bytes)
    fast = make_plan(src, "auto", **fast_opts).sparse.hot_counts
    assert 0 < min(fast) and max(fast) < 192  # some neurons, not all, on the fast tier
    ram = tuple(f + 30 for f in fast)

    def three(counts):
        return load(bundled[kind], "auto", **fast_opts, disk_options=DiskOptions(
            ram_counts=counts, cache_slots=8, read_gap=2))

    d, in_ram = three(ram), three((192, 192))
    for layer, f, n in zip(d.model.layers, fast, ram):
        ffn = layer.ffn
        assert isinstance(ffn, DiskFFN) and (ffn.n_fast, ffn.n_ram) == (f, n)
        assert ffn.fast_rows.d_ff == f and ffn.rows.d_ff == n - f + 8
    # float sums in another order only (8 cache slots: the cold neurons go in chunks)
    torch.testing.assert_close(_logits(d), _logits(in_ram), atol=5e-5, rtol=1e-4)
    assert disk_report(d.model).bytes_read > 0 and disk_report(in_ram.model).bytes_read == 0
    # one token through a layer: as SparseFFN's fast + CPU tiers of the unbundled file
    two = load(sparse_file, "auto", ffn_dtype="q4", **fast_opts)
    x = torch.randn(1, 1, src.config.d_model, generator=torch.Generator().manual_seed(0))
    for mine, theirs in zip(d.model.layers, two.model.layers):
        assert theirs.ffn.split and theirs.ffn.n_hot == mine.ffn.n_fast
        torch.testing.assert_close(mine.ffn(x, x), theirs.ffn(x, x), atol=1e-5, rtol=1e-5)
    # the budget: RAM's hot neurons are counted after the fast prefix, never it
    lay = layout_of(src)
    dp = make_plan(src, "auto", ram_budget=1.0, n_ctx=64,
                   disk_options=DiskOptions(process_bytes=0), **fast_opts).sparse.disk
    assert dp.fast_counts == tuple(fast)
    assert all(f <= c for f, c in zip(fast, dp.ram_counts))
    hot_nb = lay.bundle_bytes - (lay.row_bytes if dict(dp.parts)["gate_rows"] else 0)
    assert dict(dp.parts)["hot_neurons"] == (sum(dp.ram_counts) - sum(fast)) * hot_nb


def test_vram_budget_without_a_fast_device_warns(bundled, caplog):
    """--vram-budget on a CPU-only run: one warning, and no fast tier (every neuron RAM or disk)."""
    from sparseinfer.models.plan import make_plan

    with caplog.at_level(logging.WARNING):
        dp = make_plan(open_source(bundled["q4"]), "auto", vram_budget=1.0, ram_budget=1.0,
                       n_ctx=64, disk_options=DiskOptions(process_bytes=0)).sparse.disk
    assert "no fast device" in caplog.text and not any(dp.fast_counts)


def test_gates_first_reads_up_and_down_rows_only_where_the_gate_fired(bundled):
    """With the gates apart, a decoded token reads the cold neurons' gate rows, and the up/down
    rows only of neurons whose gate fired: every neuron whose up/down rows were read has a gate
    that is not clearly below 0 on that token's FFN input, by gguf-py's dequantization of the
    file's gate rows (the kernel rounds x to int8 blocks: a margin); fewer neurons' up/down rows
    are read than gate rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from sparseinfer.disk.layout import part_view
    from sparseinfer.sparse.packed import q4_blocks

    opts = DiskOptions(ram_counts=(0, 0), cache_slots=192, prefetch=True, read_gap=0)
    d = load(bundled["q4-gates"], "auto", disk_options=opts)
    lay = layout_of(d.source)
    gates = [dequantize(q4_blocks(torch.from_numpy(  # the q4 rows' Q4_0 blocks
        part_view(d.source, i, 0, lay.d_ff, lay, "gate").reshape(lay.d_ff, -1).copy())).numpy(),
        GGMLQuantizationType.Q4_0) for i in range(d.source.config.n_layers)]
    assert all(np.isfinite(g).all() for g in gates)
    state = {"x": {}, "decoding": False}
    reads = []  # (layer, x of that layer, neurons whose up/down rows were read)
    n_gates = 0  # gate rows read while decoding
    reader = d.model._disk_reader
    submit = reader.submit

    def spy(layer, neurons, part="bundle"):
        nonlocal n_gates
        if part == "bundle" and state["decoding"]:
            reads.append((layer, state["x"][layer], np.asarray(neurons).copy()))
        elif state["decoding"]:
            n_gates += len(neurons)
        return submit(layer, neurons, part)

    reader.submit = spy
    for i, blk in enumerate(d.model.layers):
        def hook(module, args, i=i):
            x = args[0]
            state["decoding"] = x.shape[0] * x.shape[1] == 1
            state["x"][i] = x.reshape(-1, x.shape[-1])[-1].float().numpy().copy()
        blk.ffn.register_forward_pre_hook(hook)
    _logits(d)
    assert reads, "no up/down rows read while decoding"
    for layer, x, neurons in reads:
        z = gates[layer][neurons] @ x
        margin = 0.02 * np.linalg.norm(gates[layer][neurons], axis=1) * np.linalg.norm(x)
        assert (z > -margin).all(), (layer, neurons[z <= -margin])
    assert sum(len(n) for _, _, n in reads) < n_gates


@pytest.mark.parametrize("ram,gates", [((0, 0), None), ((20, 5), (120, 60))])
def test_gates_first_sums_as_the_plain_bundles(bundled, ram, gates):
    """Gates first with every fired neuron in the cache at once: the kernel gets the whole active
    set with the neurons not fired masked out, so the logits are the plain bundles' bit for bit
    (the same list of neurons, the same sums)."""
    opts = dict(ram_counts=ram, cache_slots=192, prefetch=True, read_gap=2)
    a = _logits(load(bundled["q4"], "auto", disk_options=DiskOptions(**opts)))
    b = _logits(load(bundled["q4-gates"], "auto",
                     disk_options=DiskOptions(**opts, gate_counts=gates)))
    assert torch.equal(a, b)


def test_fused_decode_and_generation_match(bundled):
    """The CLI path (fused decode kernels, greedy generation) with a disk tier gives the same
    tokens as all in RAM."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine

    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens(engine) -> list[int]:
        ids = engine.encode("Emma was")
        return [ev.token_id for ev in engine.stream(ids, p) if getattr(ev, "token_id", -1) >= 0]

    a = tokens(Engine.load(bundled["q4"]))
    e = Engine.load(bundled["q4"], disk_options=DiskOptions(ram_counts=(10, 10), cache_slots=4))
    assert e.model.layers[0].fused is not None  # the fused decode step calls the DiskFFN
    assert 0 <= e.model._disk_reader.max_gap <= 8  # read_gap None: measured at load
    b = tokens(e)
    assert len(a) == 12 and a == b


def test_disk_tier_keeps_mapped_weights_pageable(bundled):
    """Under a disk tier the file's Q4_0 / Q4_1 matrices stay mapped (the budget lets those it
    does not lock be paged); all in RAM they go into panels (cpu/panels.py)."""
    from sparseinfer.models.plan import make_plan

    assert make_plan(open_source(bundled["q4"]), "auto", n_ctx=64).panels
    assert not make_plan(open_source(bundled["q4"]), "auto", ram_budget=1.0, n_ctx=64,
                         disk_options=DiskOptions(process_bytes=0)).panels


def test_bundled_files_take_no_dense_copy(bundled):
    """--batch-ffn dense is refused with the reason for a file of bundled neurons, in RAM or
    with its cold neurons on disk; "auto" plans none."""
    from sparseinfer.errors import SparseInferError
    from sparseinfer.models.plan import make_plan

    for opts, why in (({}, "the neurons are bundled in the file"),
                      ({"ram_budget": 1.0, "disk_options": DiskOptions(process_bytes=0)},
                       r"the cold neurons stay in the file \(disk tier\)")):
        with pytest.raises(SparseInferError, match="--batch-ffn dense: .*" + why):
            make_plan(open_source(bundled["q4"]), "auto", n_ctx=64, batch_ffn="dense", **opts)
        plan = make_plan(open_source(bundled["q4"]), "auto", n_ctx=64, **opts)
        assert not plan.sparse.batch_dense


def test_ram_budget_counts_every_part(bundled):
    src = open_source(bundled["q4"])
    lay = layout_of(src)
    from sparseinfer.models.plan import make_plan

    opts = DiskOptions(process_bytes=0)
    big = make_plan(src, "auto", ram_budget=1.0, n_ctx=64, disk_options=opts).sparse.disk
    fixed = sum(b for n, b in big.parts if n not in ("gate_rows", "hot_neurons", "neuron_caches"))
    budget_bytes = fixed + 120 * lay.bundle_bytes  # room for 120 of the 384 neurons
    budget = budget_bytes / 2**30
    plan = make_plan(src, "auto", ram_budget=budget, n_ctx=64, disk_options=opts)
    dp = plan.sparse.disk
    held = sum(b for _, b in dp.parts)
    assert budget_bytes - 2 * lay.bundle_bytes < held <= budget_bytes  # (2 layers)
    assert dp.cache_slots >= int(120 * lay.bundle_bytes * opts.cache_share) // (2 * lay.bundle_bytes)
    assert 0 < sum(dp.ram_counts) < src.config.n_layers * src.config.d_ff
    assert dict(dp.parts)["kv_cache"] == plan.kv_bytes_per_token * 64
    assert dict(dp.parts)["hot_neurons"] == sum(dp.ram_counts) * lay.bundle_bytes
    with pytest.raises(SparseInferError, match="leaving no room for FFN neurons"):
        make_plan(src, "auto", ram_budget=1e-5, disk_options=DiskOptions(process_bytes=0))
    with pytest.raises(SparseInferError, match="bundled neurons"):
        make_plan(open_source(str(bundled["q4"]).replace(".q4.gguf", ".sparse.gguf")
                              .replace("tiny.sparse", "tiny-reglu.sparse")), ram_budget=1.0)
    with pytest.raises(SparseInferError, match="oracle"):
        make_plan(src, "auto", mode="oracle", ram_budget=budget,
                  disk_options=DiskOptions(process_bytes=0))


def test_ram_budget_puts_gate_rows_first(bundled):
    """Gates first: the budget's room past the smallest caches goes to gate rows, every layer's
    hottest first; once all fit, the rest to hot neurons (their up/down rows) and caches."""
    from sparseinfer.disk.plan import MIN_SLOTS
    from sparseinfer.models.plan import make_plan

    src = open_source(bundled["q4-gates"])
    lay, cfg = layout_of(src), src.config
    L, F, nb, row = cfg.n_layers, cfg.d_ff, lay.bundle_bytes, lay.row_bytes
    opts = DiskOptions(process_bytes=0)
    big = make_plan(src, "auto", ram_budget=1.0, n_ctx=64, disk_options=opts).sparse.disk
    fixed = sum(b for n, b in big.parts if n not in ("gate_rows", "hot_neurons", "neuron_caches"))
    min_cache = min(F, MIN_SLOTS) * L * nb
    budget_bytes = fixed + min_cache + F * L * row + 40 * L * nb
    dp = make_plan(src, "auto", ram_budget=budget_bytes / 2**30, n_ctx=64,
                   disk_options=opts).sparse.disk
    parts = dict(dp.parts)
    assert dp.gate_counts == (F,) * L and parts["gate_rows"] == F * L * row
    assert sum(dp.ram_counts) > 0 and parts["hot_neurons"] == sum(dp.ram_counts) * (nb - row)
    assert sum(parts.values()) <= budget_bytes
    d = load(bundled["q4-gates"], "auto", ram_budget=budget_bytes / 2**30, n_ctx=64,
             disk_options=opts)
    ffn = d.model.layers[0].ffn
    assert ffn.gates_first and ffn.n_gate == F and ffn.gate_ram.shape == (F - ffn.n_ram, row)
    # the plain bundles: no gate rows apart, none in RAM
    plain = make_plan(open_source(bundled["q4"]), "auto", ram_budget=budget_bytes / 2**30,
                      n_ctx=64, disk_options=opts).sparse.disk
    assert plain.gate_counts == () and dict(plain.parts)["gate_rows"] == 0


@pytest.mark.parametrize("kind", ["q4-gates", "q4-gates-shuffled"])
def test_gate_rows_in_ram_read_fewer_bytes_same_logits(bundled, reference, kind):
    """Gate rows in RAM for neurons past the hot prefix: the same logits as all in RAM, and no
    gate row of theirs read while decoding."""
    base = dict(ram_counts=(20, 5), cache_slots=8, prefetch=True, read_gap=0)
    d = load(bundled[kind], "auto", disk_options=DiskOptions(**base, gate_counts=(120, 60)))
    assert [b.ffn.n_gate for b in d.model.layers] == [120, 60]
    reader = d.model._disk_reader
    submit, gate_reads = reader.submit, []

    def spy(layer, neurons, part="bundle"):
        if part == "gate":
            gate_reads.append((layer, np.asarray(neurons).copy()))
        return submit(layer, neurons, part)

    reader.submit = spy
    got = _logits(d)
    torch.testing.assert_close(got, reference["q4"], atol=1e-5, rtol=1e-5)
    assert gate_reads and all((n >= (120, 60)[layer]).all() for layer, n in gate_reads)
    with pytest.raises(SparseInferError, match="gate counts"):
        load(bundled["q4"], "auto", disk_options=DiskOptions(**base, gate_counts=(120, 60)))


def test_q4_bundles_of_q4_0_blocks_are_refused(sparse_file, tmp_path, monkeypatch):
    """A q4 bundled file without the q4 rows' layout key (written before the rows put their
    scales first: Q4_0 blocks) is refused with what to do, not read as q4 rows."""
    from sparseinfer.disk import layout

    monkeypatch.setattr(layout, "Q4_LAYOUT_KEY", "sparseinfer.bundle.unrelated")
    old = bundle_file(sparse_file, tmp_path / "old.gguf", "q4")
    monkeypatch.undo()
    with pytest.raises(SparseInferError,
                       match=r"q4_layout: expected 'scales-first'.*sparseinfer.disk upgrade"):
        layout_of(open_source(old))


def _old_bundled(sparse_file, path, monkeypatch, **kw):
    """A q4 bundled file as sparseinfer wrote it before q4 rows put their scales first: no
    layout key (written under an unrelated name), every bundle and gate row Q4_0 blocks (the
    rows turned back in place, with gguf-py's tensor offsets)."""
    import gguf

    from sparseinfer.disk import layout
    from sparseinfer.sparse.packed import q4_blocks

    monkeypatch.setattr(layout, "Q4_LAYOUT_KEY", "sparseinfer.bundle.unrelated")
    bundle_file(sparse_file, path, "q4", **kw)
    monkeypatch.undo()
    cfg = open_source(sparse_file).config
    row = cfg.d_model // 32 * 18
    for t in gguf.GGUFReader(path).tensors:
        if "ffn_bundle" in t.name and not t.name.endswith("_pos"):
            a = np.memmap(path, np.uint8, "r+", int(t.data_offset),
                          (cfg.d_ff, int(t.n_bytes) // cfg.d_ff))
            for m in range(min(3, a.shape[1] // row)):
                part = a[:, m * row:(m + 1) * row]
                part[...] = q4_blocks(torch.from_numpy(np.array(part))).numpy()
            a.flush()
            del a
    return path


@pytest.mark.parametrize("kind", ["q4", "q4-gates-shuffled"])
def test_upgrade_rewrites_q4_0_bundles_as_a_fresh_bundle(sparse_file, bundled, tmp_path,
                                                         monkeypatch, capsys, kind):
    """``python -m sparseinfer.disk upgrade``: a bundled file of Q4_0 blocks (refused as it is)
    becomes, tensor for tensor, the file bundling its sparse GGUF now writes; a file already
    in the new layout is refused with nothing to do."""
    import gguf

    from sparseinfer.disk.__main__ import main as disk_main

    cfg = open_source(sparse_file).config
    rng = np.random.default_rng(7)  # the orders of the fixture's shuffled files
    kw = ({"gates_apart": False} if kind == "q4" else
          {"orders": [rng.permutation(cfg.d_ff) for _ in range(cfg.n_layers)],
           "order_name": "random", "gates_apart": True})
    old = _old_bundled(sparse_file, tmp_path / "old.gguf", monkeypatch, **kw)
    with pytest.raises(SparseInferError, match="sparseinfer.disk upgrade"):
        layout_of(open_source(old))
    new = tmp_path / "new.gguf"
    assert disk_main(["upgrade", str(old), str(new)]) == 0
    layout_of(open_source(new))  # accepted
    fresh = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(bundled[kind]).tensors}
    before = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(old).tensors}
    assert not np.array_equal(before[BUNDLE.format(0)], fresh[BUNDLE.format(0)])
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(new).tensors}
    assert got.keys() == fresh.keys()
    for name, want in fresh.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    capsys.readouterr()
    assert disk_main(["upgrade", str(new), str(tmp_path / "again.gguf")]) == 1
    assert "nothing to upgrade" in capsys.readouterr().err


def test_truncated_file_gives_one_clear_error(bundled, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(bundled["q4"], path)
    d = load(path, "auto", disk_options=DiskOptions(ram_counts=(0, 0), cache_slots=16, read_gap=2))
    lay = layout_of(d.source)
    os.truncate(path, lay.offsets[1] + 10 * lay.stride)  # layer 1 loses most of its neurons
    with pytest.raises(DiskReadError, match="short read"):
        _logits(d)


class _Failing:
    def __init__(self, mode: str, after: int = 0):
        self.mode, self.after, self.calls = mode, after, 0

    def __call__(self, fd, bufs, offset):
        self.calls += 1
        if self.calls <= self.after:
            return os.preadv(fd, bufs, offset)
        if self.mode == "eio":
            raise OSError(errno.EIO, "Input/output error")
        return max(0, os.preadv(fd, bufs, offset) - 100)  # short


@pytest.mark.parametrize("mode", ["eio", "short"])
def test_failing_reads_raise_never_wrong_tokens(bundled, mode):
    d = load(bundled["q4"], "auto",
             disk_options=DiskOptions(ram_counts=(0, 0), cache_slots=32, read_gap=2))
    bad = _Failing(mode, after=5)
    for b in d.model.layers:
        b.ffn.cache.reader._pread = bad
    with pytest.raises(DiskReadError, match="Input/output error" if mode == "eio"
                       else "short read"):
        _logits(d)
    # nothing half-read is left valid in any cache
    for b in d.model.layers:
        c = b.ffn.cache
        valid = c.state == 1
        assert (c.slot_of[c.neuron_of[valid]] == np.flatnonzero(valid)).all()
    assert BUNDLE.format(0) in d.source.extras


def test_failing_c_reads_raise_never_wrong_tokens(bundled, tmp_path):
    """The same through the C reads (no Python pread): every reader's descriptor a directory's,
    whose reads fail with EISDIR."""
    d = load(bundled["q4"], "auto",
             disk_options=DiskOptions(ram_counts=(0, 0), cache_slots=32, read_gap=2))
    readers = list({id(b.ffn.cache.reader): b.ffn.cache.reader for b in d.model.layers}.values())
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        for r in readers:
            assert r._c_reads()
            os.close(r.fd)
            r.fd = dir_fd
        with pytest.raises(DiskReadError, match="layer 0 file rows .* failed: Is a directory"):
            _logits(d)
        for b in d.model.layers:
            c = b.ffn.cache
            valid = c.state == 1
            assert (c.slot_of[c.neuron_of[valid]] == np.flatnonzero(valid)).all()
    finally:
        for r in readers:
            r.fd = os.open(bundled["q4"], os.O_RDONLY)  # closed with the reader
        os.close(dir_fd)


def _plan_inputs():
    """Just what ``plan_disk`` reads of a source, its layout and the sparse plan: 2 ReGLU layers
    of 192 neurons hottest first, q4 bundles of 108 bytes (patch ``plan.layout_of`` with the
    layout)."""
    from unittest import mock

    class Src:
        config = mock.Mock(n_layers=2, d_ff=192, ffn_kind="reglu")
        path = "x.gguf"
        extra_array = staticmethod(lambda name: np.linspace(1.0, 0.0, 192))

    lay = mock.Mock(dtype="q4", bundle_bytes=108, stride=512, gates_apart=False)
    return Src, lay, mock.Mock(selector="predictor", ffn_dtype="q4")


def test_short_budget_lets_mapped_weights_overflow(tmp_path):
    """A budget below the mapped weights (a Q4_0 file's attention) but above what cannot be
    dropped plans every neuron on disk and warns; below that, one clear error."""
    from unittest import mock

    from sparseinfer.disk import plan as dplan
    from sparseinfer.models.plan import WeightPlan

    Src, lay, sparse = _plan_inputs()
    weights = [WeightPlan("layers.0.attn.wqkv", "ggml", ("layers.0.attn.wq.weight",), (1, 1),
                          10 << 20),
               WeightPlan("lm_head", "ggml", ("lm_head.weight",), (1, 1), 4 << 20),
               WeightPlan("layers.0.ffn", "sparse", (), (1, 1), 192 * 108 + 1000),
               WeightPlan("layers.1.ffn", "sparse", (), (1, 1), 192 * 108 + 1000)]
    opts = DiskOptions(process_bytes=0, io_threads=1)
    with mock.patch.object(dplan, "layout_of", return_value=lay):
        dp, w = dplan.plan_disk(Src, sparse, weights, 0, 8.0 / 1024, opts)  # 8 MiB < 14 MiB
        assert dp.ram_counts == (0, 0) and dp.cache_slots == 192
        # the LM head is locked in memory, the attention left to the kernel's paging
        assert dp.pinned == ("lm_head.weight",) and dp.paged_bytes == 10 << 20
        dp, w = dplan.plan_disk(Src, sparse, weights, 0, 1.0, opts)  # all fits: all locked
        assert set(dp.pinned) == {"lm_head.weight", "layers.0.attn.wq.weight"}
        assert dp.paged_bytes == 0 and dp.ram_counts == (192, 192)
        with pytest.raises(SparseInferError, match="no room for FFN neurons"):
            dplan.plan_disk(Src, sparse, weights, 0, 1e-6, opts)


def test_budget_counts_the_embedding_rows_a_context_reads():
    """An embedding mapped from the file and read a row per token counts the pages of the
    context's rows; one an LM head reads whole (tied) counts whole."""
    from unittest import mock

    from sparseinfer.disk import plan as dplan
    from sparseinfer.fileio import PAGE
    from sparseinfer.models.plan import WeightPlan

    Src, lay, sparse = _plan_inputs()
    emb = WeightPlan("tok_emb", "file", ("tok_emb.weight",), (50_000, 64), 50_000 * 36)
    ffns = [WeightPlan(f"layers.{i}.ffn", "sparse", (), (1, 1), 192 * 108) for i in (0, 1)]
    opts = DiskOptions(process_bytes=0, io_threads=1)
    with mock.patch.object(dplan, "layout_of", return_value=lay):
        head = WeightPlan("lm_head", "ggml", ("lm_head.weight",), (1, 1), 1 << 20)
        dp, _ = dplan.plan_disk(Src, sparse, [emb, head, *ffns], 0, 1.0, opts, n_ctx=100)
        parts = dict(dp.parts)
        assert parts["embedding_rows"] == 100 * 2 * PAGE  # a 36-byte row: 1 page, 2 at an edge
        assert parts["mapped_weights"] == 1 << 20 and dp.by_rows == ("tok_emb.weight",)
        dp, _ = dplan.plan_disk(Src, sparse, [emb, head, *ffns], 0, 1.0, opts)  # no context
        assert dict(dp.parts)["embedding_rows"] == emb.nbytes
        tied = WeightPlan("lm_head", "ggml", ("tok_emb.weight",), (1, 1), 0)
        dp, _ = dplan.plan_disk(Src, sparse, [emb, tied, *ffns], 0, 1.0, opts, n_ctx=100)
        assert dict(dp.parts)["embedding_rows"] == 0 and dp.by_rows == ()
        assert dict(dp.parts)["mapped_weights"] == emb.nbytes


def test_ram_takes_the_hottest_neurons_after_the_fast_tier():
    """Three tiers in the budget: RAM's neurons follow each layer's fast prefix (a layer wholly
    on the fast device included), and only they are counted."""
    from unittest import mock

    from sparseinfer.disk import plan as dplan
    from sparseinfer.models.plan import WeightPlan

    Src, lay, sparse = _plan_inputs()
    ffns = [WeightPlan(f"layers.{i}.ffn", "sparse", (), (1, 1), 192 * 108) for i in (0, 1)]
    opts = DiskOptions(process_bytes=0, io_threads=1)
    with mock.patch.object(dplan, "layout_of", return_value=lay):
        dp, _ = dplan.plan_disk(Src, sparse, ffns, 0, 1.0, opts, fast_counts=(192, 50))
        assert dp.fast_counts == (192, 50) and dp.ram_counts == (192, 192)
        assert dict(dp.parts)["hot_neurons"] == (192 - 50) * 108
        with pytest.raises(SparseInferError, match="fast tier"):
            dplan.plan_disk(Src, sparse, ffns, 0, 1.0, opts, fast_counts=(193, 0))


def test_rows_read_by_rows_bring_in_their_own_pages(tmp_path):
    """After ``read_by_rows`` (MADV_RANDOM) a looked-up row of a mapped file brings its own
    pages into the page cache, not the kernel's read-around (8 MiB on this VM's disk): what
    the budget counts for the embedding (``rows_held``) is what it holds."""
    import ctypes

    from sparseinfer.disk.plan import rows_held
    from sparseinfer.disk.tier import read_by_rows
    from sparseinfer.fileio import PAGE, libc
    from sparseinfer.models.plan import WeightPlan

    lib = libc()
    if lib is None or not hasattr(os, "posix_fadvise"):
        pytest.skip("needs Linux (madvise, mincore, posix_fadvise)")
    row, n_rows = 2880, 8192  # a 13B Q4_0 embedding's row
    path = tmp_path / "emb.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, row * n_rows, np.uint8).tobytes())

    def cached_pages(arr) -> int:
        n = -(-arr.nbytes // PAGE)
        vec = (ctypes.c_ubyte * n)()
        assert lib.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes),
                           vec) == 0
        return sum(v & 1 for v in vec)

    def touched(advise: bool) -> int:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
        os.close(fd)
        arr = np.memmap(path, dtype=np.uint8, mode="r").reshape(n_rows, row)
        if cached_pages(arr) > 4:
            pytest.skip("this filesystem keeps the file's pages cached (tmpfs?)")
        if advise:
            src = mock_src(arr)
            assert read_by_rows(src, ["tok_emb.weight"]) == arr.nbytes
        ids = np.arange(50, n_rows, n_rows // 20)[:20]
        assert arr[ids].sum() >= 0  # the lookup
        return cached_pages(arr), ids.size

    def mock_src(arr):
        from unittest import mock
        t = mock.Mock(gguf=object(), raw=lambda: arr)
        return mock.Mock(tensors={"tok_emb.weight": t})

    plain, _ = touched(False)
    advised, k = touched(True)
    w = WeightPlan("tok_emb", "file", ("tok_emb.weight",), (n_rows, row), n_rows * row)
    assert advised <= 2 * k and advised * PAGE <= rows_held(w, k)
    assert plain >= 4 * advised  # the read-around: 8 MiB here, 128 KiB on most disks


def test_pin_mapped_locks_the_tensor_pages(smollm2_path):
    from sparseinfer.disk.tier import pin_mapped

    def locked() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
        return 0

    src = open_source(smollm2_path)
    name = "layers.0.attn.wq.weight"
    before = locked()
    n = pin_mapped(src, [name])
    if n == 0:
        pytest.skip("mlock refused here (no CAP_IPC_LOCK / RLIMIT_MEMLOCK)")
    assert n == src.tensors[name].nbytes
    assert locked() - before >= n - 2 * 4096  # whole pages inside the tensor, at least


@pytest.mark.slow
def test_convert_writes_a_bundled_file(tiny_model_dir, tmp_path, caplog):
    """`convert --disk-bundle q4 --disk-order coactivation` leaves the bundled layout in place of
    the plain sparse file (no temporary file behind), its neurons in co-activation order (its
    progress logged per layer), and it runs with every neuron read from disk as all in RAM."""
    out = tmp_path / "tiny.bundled.gguf"
    caplog.set_level(logging.INFO, logger="sparseinfer")
    assert main(["convert", "-m", str(tiny_model_dir("reglu")), "-o", str(out), *FAST,
                 "--disk-bundle", "q4", "--disk-order", "coactivation", "--eval-chunks", "0",
                 "--no-report"]) == 0
    src = open_source(out)
    lay = layout_of(src)
    assert lay.stride % 512 == 0 and "layers.0.ffn.gate.weight" not in src.tensors
    assert lay.gates_apart  # q4 rows of a ReLU gate: gates first by default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.bundled.gguf"]
    assert "co-activation order: done, 2 layers" in caplog.text
    assert src.metadata["sparseinfer.bundle.order"] == "coactivation"
    from sparseinfer.offline.report import file_summary
    assert "bundled for the disk tier: q4 rows" in file_summary(src.metadata)
    assert "in coactivation order, gate rows apart" in file_summary(src.metadata)
    assert lay.positions is not None and any(
        not np.array_equal(p, np.arange(lay.d_ff)) for p in lay.positions)
    ram = _logits(load(out, "auto", disk_options=DiskOptions(ram_counts=(192, 192),
                                                             cache_slots=1)))
    disk = _logits(load(out, "auto", disk_options=DiskOptions(ram_counts=(0, 0), cache_slots=192)))
    assert torch.equal(disk, ram)
