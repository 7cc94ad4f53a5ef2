"""Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K in panels of 16 rows (cpu/panels.py,
the Q4_0x16 ... Q5_1x16 kernels): the rearrangement (C, against numpy) round-trips and puts
the bytes where qgemv.h says;
the ISAs agree (Q4 bit for bit); a loaded model holds its matrices as panels and still decodes
what the file's rows decode (tests/cpu/test_qgemv.py compares the kernels with the references
over shapes, ISAs, threads and batch sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.cpu import reference as ref
from sparseinfer.cpu.panels import from_panels, panel_type, to_panels, to_panels_ref

gguf = pytest.importorskip("gguf")


def checked_panels(raw: np.ndarray, type_name: str, rows: int, cols: int, threads: int,
                   panel: str | None = None) -> np.ndarray:
    """``to_panels`` on ``threads`` threads, checked against the numpy rearrangement and undone
    exactly by ``from_panels``."""
    before = cpu.get_threads()
    cpu.set_threads(threads)
    try:
        pan = to_panels(raw, type_name, rows, cols, panel)
    finally:
        cpu.set_threads(before)
    assert pan.shape == (raw.size,)
    assert np.array_equal(pan, to_panels_ref(raw, type_name, rows, cols, panel))
    assert np.array_equal(from_panels(pan, type_name, rows, cols, panel), raw)
    return pan


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_round_trip_and_layout(type_name, threads):
    """The C rearrangement equals the numpy one (over 35 panels: several pool chunks), both
    undo exactly, and the bytes sit where qgemv.h says."""
    rng = np.random.default_rng(0)
    rows, cols = 560, 96
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])  # (rows, row bytes)
    pan = checked_panels(raw, type_name, rows, cols, threads)
    # the layout qgemv.h states: panel 1, block column 2: 16 scales, then quant word c of row r
    words, bsize = {"Q4_0": (1, 18), "Q4_1": (2, 20), "Q8_0": (1, 34), "Q5_0": (1, 22),
                    "Q5_1": (2, 24)}[type_name]
    blk = pan.reshape(rows // 16, cols // 32, 16 * bsize)[1, 2]
    for w in range(words):  # d x 16 (and m x 16)
        assert np.array_equal(blk[32 * w:32 * w + 32].view(np.uint16),
                              raw[16:32, 2 * bsize + 2 * w:2 * bsize + 2 * w + 2]
                              .copy().view(np.uint16).reshape(-1))
    nq = (bsize - 2 * words) // 4
    q = blk[32 * words:].reshape(nq, 16, 4)
    first = 0
    if type_name in ("Q5_0", "Q5_1"):  # word 0: each row's fifth bits, bit 8k + s = the file's
        first = 1                        # bit 4s + k
        stored = q[0].copy().view(np.uint32).reshape(-1)
        h = 2 * bsize + 2 * words
        filed = raw[16:32, h:h + 4].copy().view(np.uint32).reshape(-1)
        for r in range(16):
            want = sum(((int(filed[r]) >> (4 * s + k)) & 1) << (8 * k + s)
                       for k in range(4) for s in range(8))
            assert int(stored[r]) == want
    for c in range(first, nq):
        assert np.array_equal(q[c], raw[16:32, 2 * bsize + 2 * words + 4 * c:
                                        2 * bsize + 2 * words + 4 * c + 4])


def k_rows(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf-py only dequantizes them): random bytes, small positive fp16
    scales (Q4_K / Q5_K: d and dmin; Q6_K: d)."""
    blocks = rng.integers(0, 256, (rows * cols // 256, cpu.TYPES[type_name][2]), dtype=np.uint8)
    for off in (208,) if type_name == "Q6_K" else (0, 2):
        scale = rng.uniform(0.0, 0.02, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quant_round_trip_and_layout(type_name, threads):
    """Q4_K / Q5_K: the C rearrangement equals the numpy one over 35 panels, both undo exactly,
    and every field sits where qgemv.h says, each six-bit scale and minimum decoded here bit by
    bit from the file's 12 bytes as llama.cpp's get_scale_min_k4 reads them."""
    rng = np.random.default_rng(0)
    rows, cols = 560, 768
    bsize = cpu.TYPES[type_name][2]
    raw = k_rows(type_name, rows, cols, rng)
    pan = checked_panels(raw, type_name, rows, cols, threads)
    blk = pan.reshape(rows // 16, cols // 256, 16 * bsize)[1, 2]  # panel 1, super-block column 2
    src = raw[16:32, 2 * bsize:3 * bsize]  # its 16 rows' blocks in the file
    assert np.array_equal(blk[:32], src[:, 0:2].reshape(-1))  # d x 16
    assert np.array_equal(blk[32:64], src[:, 2:4].reshape(-1))  # dmin x 16
    for r in range(16):
        q = [int(v) for v in src[r, 4:16]]
        for j in range(8):
            if j < 4:
                sc, m = q[j] & 63, q[j + 4] & 63
            else:
                sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
                m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
            for off, hoff, v in ((64, 192, sc), (128, 224, m)):
                assert (int(blk[off + 16 * (j % 4) + r]) >> (4 * (j // 4))) & 15 == v & 15
                word = int(blk[hoff + 2 * r]) | int(blk[hoff + 1 + 2 * r]) << 8
                assert (word >> (2 * j)) & 3 == v >> 4
        qo, qs = (256, 16) if type_name == "Q4_K" else (768, 48)
        for w in range(32):  # quant word w: the file's qs bytes 4w .. 4w + 3
            assert np.array_equal(blk[qo + 64 * w + 4 * r:qo + 64 * w + 4 * r + 4],
                                  src[r, qs + 4 * w:qs + 4 + 4 * w])
        for w in range(8 if type_name == "Q5_K" else 0):  # fifth-bit word w: qh bytes 4w ..
            assert np.array_equal(blk[256 + 64 * w + 4 * r:256 + 64 * w + 4 * r + 4],
                                  src[r, 16 + 4 * w:20 + 4 * w])


@pytest.mark.parametrize("threads", [1, 2])
def test_q6_k_round_trip_and_layout(threads):
    """Q6_K: the C rearrangement equals the numpy one over 35 panels, both undo exactly, and
    every field sits where qgemv.h says."""
    rng = np.random.default_rng(2)
    rows, cols = 560, 768
    raw = k_rows("Q6_K", rows, cols, rng)
    pan = checked_panels(raw, "Q6_K", rows, cols, threads)
    blk = pan.reshape(rows // 16, cols // 256, 3360)[1, 2]  # panel 1, super-block column 2
    src = raw[16:32, 2 * 210:3 * 210]
    for r in range(16):
        assert np.array_equal(blk[2 * r:2 * r + 2], src[r, 208:210])  # d
        assert all(blk[32 + 16 * i + r] == src[r, 192 + i] for i in range(16))  # scales
        for v in range(16):  # qh words
            assert np.array_equal(blk[288 + 64 * v + 4 * r:292 + 64 * v + 4 * r],
                                  src[r, 128 + 4 * v:132 + 4 * v])
        for u in range(32):  # ql words
            assert np.array_equal(blk[1312 + 64 * u + 4 * r:1316 + 64 * u + 4 * r],
                                  src[r, 4 * u:4 + 4 * u])


@pytest.mark.parametrize("threads", [1, 2])
def test_q6_k_bytes_round_trip_and_layout(threads):
    """Q6_Kx16b (Q6_K's six-bit weights byte-aligned): the C rearrangement equals the numpy one
    over 35 panels, both undo exactly, and each weight sits where qgemv.h says — the weights read
    here from gguf-py's dequantization of blocks with d = 1 and every scale 1 (q - 32 exactly),
    not from our own reading of ql and qh."""
    rng = np.random.default_rng(3)
    rows, cols = 560, 768
    raw = k_rows("Q6_K", rows, cols, rng)
    blocks = raw.reshape(rows, cols // 256, 210)
    blocks[:, :, 192:208] = 1  # every sub-block's scale
    blocks[:, :, 208:210] = np.array([1.0], np.float16).view(np.uint8)
    pan = checked_panels(raw, "Q6_K", rows, cols, threads, "Q6_Kx16b")
    q = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(rows, cols) + 32
    assert q.min() >= 0 and q.max() <= 63 and np.array_equal(q, np.round(q))
    q = q.astype(np.int64)
    for p, sb in ((1, 2), (34, 0)):  # panel, super-block column
        blk = pan.reshape(rows // 16, cols // 256, 3360)[p, sb]
        src = raw[16 * p:16 * p + 16, 210 * sb:210 * sb + 210]
        d = src[:, 208:210].copy().view(np.uint16)[:, 0]
        assert np.array_equal(blk[:32].view(np.uint16), d)
        assert np.array_equal(blk[32:288].reshape(16, 16), src[:, 192:208].T)  # scale i, row r
        w = q[16 * p:16 * p + 16, 256 * sb:256 * sb + 256].reshape(16, 16, 4, 4)  # r, i, c, e
        words = blk[288:].reshape(16, 3, 16, 4)  # i, m, r, e
        for m in range(3):
            want = w[:, :, m, :] | ((w[:, :, 3, :] >> (2 * m)) & 3) << 6  # r, i, e
            assert np.array_equal(words[:, m].transpose(1, 0, 2), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_q5_k_bytes_round_trip_and_layout(threads):
    """Q5_Kx16b (Q5_K's five-bit weights byte-aligned): the C rearrangement equals the numpy one
    over 35 panels, both undo exactly, d, dmin, scales and minima sit as in Q5_Kx16, and each
    weight where qgemv.h says — the weights read here from gguf-py's dequantization of blocks
    with d = 1, dmin = 0 and every sub-block scale 1 (q exactly), not from our own reading of qs
    and qh."""
    rng = np.random.default_rng(5)
    rows, cols = 560, 768
    raw = k_rows("Q5_K", rows, cols, rng)
    blocks = raw.reshape(rows, cols // 256, 176)
    blocks[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[:, :, 2:4] = 0  # dmin
    blocks[:, :, 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]  # six-bit scales 1, minima 0
    pan = checked_panels(raw, "Q5_K", rows, cols, threads, "Q5_Kx16b")
    q = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(rows, cols)
    assert q.min() >= 0 and q.max() <= 31 and np.array_equal(q, np.round(q))
    q = q.astype(np.int64)
    old = to_panels(raw, "Q5_K", rows, cols).reshape(rows // 16, cols // 256, 2816)
    for p, sb in ((1, 2), (34, 0)):  # panel, super-block column
        blk = pan.reshape(rows // 16, cols // 256, 2816)[p, sb]
        assert np.array_equal(blk[:256], old[p, sb, :256])
        w = q[16 * p:16 * p + 16, 256 * sb:256 * sb + 256].reshape(16, 8, 8, 4)  # r, j, c, e
        t = w[:, :, 5] | w[:, :, 6] << 5 | w[:, :, 7] << 10  # r, j, e
        words = blk[256:].reshape(8, 5, 16, 4)  # j, m, r, e
        for m in range(5):
            want = w[:, :, m, :] | ((t >> (3 * m)) & 7) << 5
            assert np.array_equal(words[:, m].transpose(1, 0, 2), want)


def test_panel_type_by_isa_and_errors():
    """Q6_K and Q5_K take the byte-aligned panels on the 256-bit ISAs, their x16 ones on
    AVX-512; the other types have one panel type; a panel type of another file type is
    refused."""
    assert [panel_type("Q6_K", i) for i in ("avx2", "avx2_vnni", "avx2_128", "avx512")] == \
        ["Q6_Kx16b", "Q6_Kx16b", "Q6_Kx16b", "Q6_Kx16"]
    assert [panel_type("Q5_K", i) for i in ("avx2", "avx2_vnni", "avx2_128", "avx512")] == \
        ["Q5_Kx16b", "Q5_Kx16b", "Q5_Kx16b", "Q5_Kx16"]
    assert panel_type("Q4_K", "avx2") == "Q4_Kx16" and panel_type("Q3_K", "avx2") is None
    raw = np.zeros(16 * 210, np.uint8)
    with pytest.raises(ValueError, match=r"panel type of Q4_K: expected one of \['Q4_Kx16'\], "
                                         r"got 'Q6_Kx16b'"):
        to_panels_ref(raw, "Q4_K", 16, 256, "Q6_Kx16b")
    with pytest.raises(ValueError, match="panel type of Q6_K: expected one of"):
        from_panels(raw, "Q6_K", 16, 256, "Q4_Kx16")


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K"])
def test_byte_aligned_layouts_agree(type_name, isa, threads):
    """Q6_Kx16b's and Q5_Kx16b's kernels (the same 256-bit code on every ISA) do Q6_Kx16's and
    Q5_Kx16's integer sums and float operations: the same bits for one x row and for batches,
    on every ISA and thread count here; Q6_K's GEMV of rows of 64 blocks or more reads two
    panels at once (5 panels: pairs and one alone), rows of 1,024 columns one at a time."""
    rng = np.random.default_rng(4)
    for rows, cols in ((80, 2304), (48, 1024)):
        assert_layouts_agree(type_name, rows, cols, rng)


def assert_layouts_agree(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> None:
    raw = k_rows(type_name, rows, cols, rng)
    mats = [cpu.QuantMatrix(p, to_panels(raw, type_name, rows, cols, p), rows, cols)
            for p in (type_name + "x16", type_name + "x16b")]
    X = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    a, b = (cpu.gemm(m, X) for m in mats)
    assert torch.equal(a, b)
    for t in (0, 7):
        outs = [torch.empty(rows), torch.empty(rows)]
        cpu.gemv(mats, X[t].contiguous(), outs)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], b[t])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                       "Q6_K"])
def test_isas_agree(type_name):
    """Q4 (Q4_K too), Q5_0, Q5_1, Q5_K and Q6_K panels: the AVX-512 and AVX2 kernels do the same
    integer sums and float operations per row, bit for bit (Q5_0, Q5_1: the same 256-bit code in
    every build). Q8_0: the AVX-512 kernel adds 128 to every weight and takes it back in float,
    so the ISAs agree to float rounding."""
    isas = [i for i in ("avx512", "avx2", "avx2_vnni", "avx2_128") if i in cpu.available_isas()]
    if len(isas) < 2:
        pytest.skip("one instruction set on this CPU")
    rng = np.random.default_rng(1)
    rows, cols = 64, 576
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        cols = 512
        raw = k_rows(type_name, rows, cols, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                   gguf.GGMLQuantizationType[type_name])
    mat = cpu.QuantMatrix(type_name + "x16", to_panels(raw, type_name, rows, cols), rows, cols)
    X = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    got = {}
    try:
        for isa in isas:
            cpu.set_isa(isa)
            got[isa] = cpu.gemm(mat, X)
    finally:
        cpu.set_isa("auto")
    for isa in isas[1:]:
        if type_name == "Q8_0":
            torch.testing.assert_close(got[isa], got[isas[0]], rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(got[isa], got[isas[0]]), isa


def test_errors_name_expected_and_found():
    raw = np.zeros(20 * 20, dtype=np.uint8)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        to_panels(raw, "Q4_1", 20, 32)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        to_panels_ref(raw, "Q4_1", 20, 32)
    with pytest.raises(ValueError, match="expected one of"):
        to_panels(raw, "Q5_K_S", 16, 32)
    with pytest.raises(ValueError, match="expected 320 bytes, got 400"):
        to_panels(raw, "Q4_1", 16, 32)
    with pytest.raises(ValueError, match="rows a multiple of 16, got 20"):
        cpu.QuantMatrix("Q4_1x16", raw, 20, 32)
    with pytest.raises(ValueError, match="cols of 256, got rows=16 cols=96"):
        to_panels(np.zeros(16 * 96, np.uint8), "Q4_K", 16, 96)


@pytest.mark.slow
def test_loaded_model_holds_panels(smollm2_path):
    """SmolLM2's Q4_1 projections and Q8_0 head load as panels; a layer's down projection
    decodes to what gguf-py decodes from the file's own rows."""
    from sparseinfer.engine import Engine
    from sparseinfer.quant.linear import GGMLLinear

    model = Engine.load(smollm2_path, n_ctx=64).model
    lins = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    kinds = {m.type_name for lin in lins for m in lin.mats}
    assert kinds == {"Q4_1x16", "Q8_0x16"}
    down = next(m for m in lins if (m.out_features, m.in_features) == (576, 1536))  # layer 0
    t = next(t for t in gguf.GGUFReader(str(smollm2_path)).tensors
             if t.name == "blk.0.ffn_down.weight")
    want = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q4_1).reshape(576, 1536)
    assert np.array_equal(down.dequantized().numpy(), want)
    assert np.array_equal(ref.dequantize_ref(down.mats[0]).numpy(), want)


def test_weight_source_gives_panels_or_the_files_rows(smollm2_path):
    """``ggml_parts``: a Q4_1 matrix of whole panels rearranged (its mapped pages released), or
    with panels off (a disk tier's plan) the file's rows, mapped and uncopied."""
    from sparseinfer.models.build import WeightSource
    from sparseinfer.models.loading import open_source

    src = open_source(smollm2_path)
    ws = WeightSource(src, ("layers.0.ffn.down.weight",))
    [(kind, raw, rows)], [(kind0, raw0, _)] = ws.ggml_parts(), ws.ggml_parts(panels=False)
    assert (kind, kind0, rows) == ("Q4_1x16", "Q4_1", 576)
    assert not raw0.flags.writeable  # the read-only map itself
    assert np.array_equal(from_panels(raw, "Q4_1", 576, 1536), raw0)
