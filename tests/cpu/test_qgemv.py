"""sparseinfer.cpu: GEMV/GEMM over GGUF blocks vs pure-torch references (gguf-py dequantizes).

Every type x both ISAs (where the CPU has them) x 1 and 2 threads, over shapes whose rows are
not a multiple of the 4-row unroll or of the 16-row chunk. Two comparisons: against the float32
input (tolerance: half a quantization step of each int8 activation block, the rounding the
kernels make on purpose) and against the input rounded exactly as the kernels round it (float32
summation order only).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sparseinfer import cpu
from sparseinfer.cpu import build as cpu_build
from sparseinfer.cpu import ops
from sparseinfer.cpu import reference as ref
from sparseinfer.cpu.panels import FILE_TYPES, to_panels_ref

gguf = pytest.importorskip("gguf")

EPS = torch.finfo(torch.float32).eps
# fp16 fields (byte offsets) of the K-quant blocks, set to small positive scales
K_FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# 288, 160, 224, 1056: groups of 4 blocks and a last partial group of 1, 1, 3, 1 (AVX-512)
SHAPES_32 = [(1, 32), (3, 96), (7, 288), (37, 160), (130, 64), (9, 224), (5, 1056)]
SHAPES_256 = [(1, 256), (5, 512), (37, 256), (66, 768)]
# panels of 16 rows (Q4_0x16 ... Q5_0x16): one or several panels, 1 to 33 blocks per row; from 64
# blocks (PANEL_TWO_NB) the AVX2 GEMV reads Q4_0 ... Q5_1 panels two at once: 3 panels (a pair and
# one alone), 4 (two pairs)
SHAPES_PANEL = [(16, 32), (32, 96), (48, 288), (16, 160), (144, 64), (32, 1056), (48, 2080),
                (64, 2048)]
# K-quant panels: one or several panels, 1 to 11 super-blocks per row
SHAPES_PANEL_256 = [(16, 256), (32, 512), (48, 768), (144, 256), (32, 2816)]


def random_raw(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks: quantized by gguf-py where it can, else random bytes with sane fp16
    scale fields (K-quants: gguf-py only dequantizes them)."""
    if type_name in FILE_TYPES:  # the file's blocks, rearranged
        base = FILE_TYPES[type_name]
        return to_panels_ref(random_raw(base, rows, cols, rng), base, rows, cols, type_name)
    if type_name in ("F16", "F32"):
        w = rng.standard_normal((rows, cols)).astype(np.float16 if type_name == "F16" else np.float32)
        return w.view(np.uint8).reshape(-1)
    if type_name == "BF16":  # float32's top halves (gguf-py's BF16 dequantization reads them)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    if type_name in GGUF_QUANTIZES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    _, elems, size = cpu.TYPES[type_name]
    blocks = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    for off in K_FP16_FIELDS[type_name]:
        scale = rng.uniform(0.0, 0.02, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return blocks.reshape(-1)


def shapes_for(type_name: str) -> list[tuple[int, int]]:
    if type_name in FILE_TYPES:
        return SHAPES_PANEL_256 if cpu.TYPES[type_name][1] == 256 else SHAPES_PANEL
    return SHAPES_256 if cpu.TYPES[type_name][1] == 256 else SHAPES_32


def cases():
    for t in cpu.TYPES:
        for rows, cols in shapes_for(t):
            yield pytest.param(t, rows, cols, id=f"{t}-{rows}x{cols}")


def x_rounding_bound(mat: cpu.QuantMatrix, x: torch.Tensor) -> torch.Tensor:
    """Per output row: the most the int8 rounding of x can move it (|x - q·d| <= d/2 per element)
    plus float32 summation slack."""
    w = ref.dequantize_ref(mat).double().abs()
    if mat.type_name in ("F16", "BF16", "F32"):
        step = torch.zeros(mat.cols, dtype=torch.float64)
    elif ref.x_block(mat.type_name) == 128:  # (Q6_K on plain AVX2 and AVX-512, Q5_K on AVX-512)
        _, d, _ = ref.quantize_xk_ref(x)
        step = d.double().repeat_interleave(128) / 2
    else:
        _, d, _ = ref.quantize_x_ref(x)
        step = d.double().repeat_interleave(32) / 2
    nb = mat.cols // 32
    return w @ step * (1 + 1e-3) + (nb + 16) * EPS * (w @ x.double().abs()) + EPS


def summation_bound(mat: cpu.QuantMatrix, x: torch.Tensor) -> torch.Tensor:
    w = ref.dequantize_ref(mat).double().abs()
    return (mat.cols // 32 + 16) * EPS * (w @ x.double().abs()) + EPS


@pytest.mark.parametrize("type_name,rows,cols", list(cases()))
def test_gemv_matches_reference(type_name, rows, cols, isa, threads):
    rng = np.random.default_rng(rows * 1000 + cols)
    mat = cpu.QuantMatrix(type_name, random_raw(type_name, rows, cols, rng), rows, cols)
    x = torch.from_numpy(rng.standard_normal(cols).astype(np.float32))
    out, want, want_q8 = torch.empty(rows), torch.empty(rows), torch.empty(rows)
    cpu.gemv([mat], x, [out])
    ref.gemv_ref([mat], x, [want])
    ref.gemv_q8_ref([mat], x, [want_q8])
    assert torch.all((out.double() - want.double()).abs() <= x_rounding_bound(mat, x))
    assert torch.all((out.double() - want_q8.double()).abs() <= summation_bound(mat, x))


# (one row each is gemm_each of one row each: every type is in gemm_each's test)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_0x16", "Q8_0x16", "Q4_Kx16", "Q6_K", "BF16"])
def test_gemv_each_matrix_on_its_own_row(type_name, isa, threads):
    """``GemvPlan(..., each=True)`` (a mixture of experts' down products: matrix i against x row
    i, one dispatch): each output equals ``gemv`` of that matrix on that row bit for bit, and the
    pure-torch reference (``gemv_each_ref``) within the int8 rounding of x; 16 matrices of
    several heights."""
    rng = np.random.default_rng(7)
    rows_cols = shapes_for(type_name)
    cols = max(c for _, c in rows_cols)
    heights = [r for r, c in rows_cols if c == cols] * 3
    mats = [cpu.QuantMatrix(type_name, random_raw(type_name, r, cols, rng), r, cols)
            for r in (heights * 16)[:16]]
    x = torch.from_numpy(rng.standard_normal((len(mats), cols)).astype(np.float32))
    outs = [torch.empty(m.rows) for m in mats]
    cpu.GemvPlan(mats, outs, each=True)(x)
    for m, xi, out in zip(mats, x, outs):
        alone = torch.empty(m.rows)
        cpu.gemv([m], xi.contiguous(), [alone])
        assert torch.equal(out, alone)
    wants = [torch.empty(m.rows) for m in mats]
    ref.gemv_each_ref(mats, x, wants)
    for m, xi, out, want in zip(mats, x, outs, wants):
        assert torch.all((out.double() - want.double()).abs() <= x_rounding_bound(m, xi))


@pytest.mark.parametrize("type_name", list(cpu.TYPES))
def test_gemm_each_matrix_on_its_own_rows(type_name, isa, threads):
    """``gemm_each`` (a mixture of experts' prompt: matrix i against its own next counts[i] rows
    of x, one dispatch): each output row equals ``gemv`` of its matrix on that row bit for bit
    (the GEMM's rows are its GEMV's), and the pure-torch reference within the int8 rounding of
    x, for counts of 1 to 9 rows."""
    rng = np.random.default_rng(8)
    rows_cols = shapes_for(type_name)
    cols = max(c for _, c in rows_cols)
    heights = [r for r, c in rows_cols if c == cols]
    counts = [1, 3, 2, 9, 1, 4, 5, 1, 2, 7, 1, 1, 3, 6, 2, 8]
    mats = [cpu.QuantMatrix(type_name, random_raw(type_name, r, cols, rng), r, cols)
            for r in (heights * 16)[:16]]
    x = torch.from_numpy(rng.standard_normal((sum(counts), cols)).astype(np.float32))
    outs = [torch.empty(c, m.rows) for c, m in zip(counts, mats)]
    cpu.gemm_each(mats, x, counts, outs)
    wants = [torch.empty(c, m.rows) for c, m in zip(counts, mats)]
    ref.gemm_each_ref(mats, x, counts, wants)
    at = 0
    for m, c, out, want in zip(mats, counts, outs, wants):
        for t in range(c):
            alone = torch.empty(m.rows)
            cpu.gemv([m], x[at + t].contiguous(), [alone])
            assert torch.equal(out[t], alone)
            assert torch.all((out[t].double() - want[t].double()).abs()
                             <= x_rounding_bound(m, x[at + t]))
        at += c
    with pytest.raises(ValueError, match="expected contiguous float32"):
        cpu.gemm_each(mats[:2], x[:3], [1, 1], outs[:2])


# fp16 fields of the 32-weight block types (d; Q4_1 / Q5_1: d, m)
B32_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                                       "Q4_0x16", "Q4_1x16", "Q5_0x16", "Q5_1x16", "Q4_Kx16",
                                       "Q5_Kx16", "Q6_Kx16", "Q6_Kx16b", "Q5_Kx16b"])
def test_largest_integer_sums(type_name, isa, threads):
    """Every quant at its largest code (all bytes 0xFF: 4-bit 15, 5-bit 31, 6-bit 63, every
    K-quant sub-block scale 63) against x of one sign, so that every x byte quantizes to 127: the
    kernels' int16 partial sums (8 products of 5-bit weights reach 31496) at their bound, in the
    GEMV and in the GEMM."""
    base = FILE_TYPES.get(type_name, type_name)
    _, elems, size = cpu.TYPES[base]
    rows, cols = 37, 512
    blocks = np.full((rows * cols // elems, size), 0xFF, dtype=np.uint8)
    for off in K_FP16_FIELDS.get(base, B32_FP16_FIELDS.get(base, ())):
        blocks[:, off : off + 2] = np.array([0.01], np.float16).view(np.uint8)
    raw = blocks.reshape(-1)
    if type_name in FILE_TYPES:
        rows = 48
        raw = to_panels_ref(np.tile(blocks, (48 // 37 + 1, 1))[: rows * cols // elems].reshape(-1),
                            base, rows, cols, type_name)
    mat = cpu.QuantMatrix(type_name, raw, rows, cols)
    X = torch.arange(1.0, 9.0).view(8, 1).expand(8, cols).contiguous()  # every x byte 127
    assert_gemv_rows(mat, X)


def assert_gemv_rows(mat: cpu.QuantMatrix, X: torch.Tensor) -> None:
    """Each row of X's GEMV is the GEMM's row bit for bit and within the rounding bound of the
    reference."""
    got = cpu.gemm(mat, X)
    want = ref.gemm_ref(mat, X)
    for t in range(X.shape[0]):
        one = torch.empty(mat.rows)
        cpu.gemv([mat], X[t].contiguous(), [one])
        assert torch.equal(got[t], one)
        assert torch.all((one.double() - want[t].double()).abs() <= x_rounding_bound(mat, X[t]))


@pytest.mark.parametrize("type_name", ["Q4_0x16", "Q4_1x16", "Q5_0x16", "Q5_1x16", "Q8_0x16"])
@pytest.mark.parametrize("rows", [16, 48, 384, 1024])
def test_panel_pairs_are_each_panel_alone(type_name, rows, isa, threads):
    """Rows of 65 blocks: the 256-bit GEMV reads the panels of each chunk of rows two at once
    (panel i beside panel i + np / 2; an odd one alone), each with its own operations. The pool's
    chunks here: 1 or 2 panels (16, 48 rows), 3 (384 rows, one thread), 4 and 8 (1,024 rows).
    Every output is, bit for bit, the GEMM's (which takes the panels one by one) and within the
    rounding bound of the reference."""
    rng = np.random.default_rng(rows)
    cols = 2080
    mat = cpu.QuantMatrix(type_name, random_raw(type_name, rows, cols, rng), rows, cols)
    assert_gemv_rows(mat, torch.from_numpy(rng.standard_normal((3, cols)).astype(np.float32)))


def test_numpy_arguments():
    rng = np.random.default_rng(5)
    mat = cpu.QuantMatrix("Q8_0", random_raw("Q8_0", 9, 64, rng), 9, 64)
    x = rng.standard_normal(64).astype(np.float32)
    out, want = np.empty(9, np.float32), torch.empty(9)
    cpu.gemv([mat], x, [out])
    ref.gemv_q8_ref([mat], torch.from_numpy(x), [want])
    assert torch.all((torch.from_numpy(out).double() - want.double()).abs()
                     <= summation_bound(mat, torch.from_numpy(x)))


def test_multi_matrix_call_shares_input(isa, threads):
    """q, k, v of different types and heights in one call: each as if computed alone."""
    rng = np.random.default_rng(1)
    cols = 512
    specs = [("Q4_K", 64), ("Q6_K", 21), ("Q8_0", 21), ("Q4_0", 130), ("F16", 5), ("F32", 3),
             ("BF16", 7), ("Q4_1x16", 32), ("Q5_0x16", 16), ("Q5_1x16", 16), ("Q4_Kx16", 32), ("Q5_Kx16", 16),
             ("Q6_Kx16", 16), ("Q6_Kx16b", 32), ("Q5_Kx16b", 16)]
    mats = [cpu.QuantMatrix(t, random_raw(t, r, cols, rng), r, cols) for t, r in specs]
    x = torch.from_numpy(rng.standard_normal(cols).astype(np.float32))
    outs = [torch.empty(m.rows) for m in mats]
    cpu.gemv(mats, x, outs)
    plan_outs = [torch.empty(m.rows) for m in mats]
    plan = cpu.GemvPlan(mats, plan_outs)
    plan(x)
    for m, o, po in zip(mats, outs, plan_outs):
        alone, want = torch.empty(m.rows), torch.empty(m.rows)
        cpu.gemv([m], x, [alone])
        ref.gemv_q8_ref([m], x, [want])
        assert torch.equal(o, alone) and torch.equal(po, alone)
        assert torch.all((o.double() - want.double()).abs() <= summation_bound(m, x))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                       "Q6_K", "F16", "BF16", "F32", "Q4_0x16", "Q4_1x16",
                                       "Q8_0x16",
                                       "Q5_0x16", "Q5_1x16", "Q4_Kx16", "Q5_Kx16", "Q6_Kx16",
                                       "Q6_Kx16b", "Q5_Kx16b"])
@pytest.mark.parametrize("T", [1, pytest.param(3, marks=pytest.mark.slow), 8, 9, 13,
                               pytest.param(17, marks=pytest.mark.slow)])
def test_gemm_matches_reference(type_name, T, isa, threads):
    """Q4_0/Q4_1 rows take the AVX-512 kernel that gathers each group of 4 blocks once for up to
    8 rows of x (576 columns: 4 groups and a partial one of 2 blocks), Q4_0..Q5_1 the avx2_128 and
    plain AVX2 ones that unpack each group of 8 blocks once (T = 8, 9, 13, 17 cross their groups);
    plain AVX2 Q4_K/Q5_K passes of 4 to 8 x rows put the rows in lanes (T = 8, 13: 8 and 5 rows,
    the last lanes empty), shorter ones do not (T = 1, 3, 9's last row); AVX-512 K-quants decode
    each super-block once for a pass's x rows (from T = 2; 9's last pass of one row too); every
    type gives each row of the batch exactly the GEMV of that token (panels: 8 x rows per pass
    over 3 panels)."""
    rng = np.random.default_rng(T)
    # 576: 18 blocks, two past the last group of 8 (AVX-512: of 4); 224: 7 blocks, 3 past a group of 4
    rows, cols = 37, 576 if T % 2 == 0 else 224 if T == 9 else 512
    if type_name in FILE_TYPES:
        rows = 48
    if type_name in ("Q4_K", "Q5_K", "Q6_K", "Q4_Kx16", "Q5_Kx16", "Q6_Kx16", "Q6_Kx16b",
                     "Q5_Kx16b"):
        cols = 512
    mat = cpu.QuantMatrix(type_name, random_raw(type_name, rows, cols, rng), rows, cols)
    X = torch.from_numpy(rng.standard_normal((T, cols)).astype(np.float32))
    got = cpu.gemm(mat, X)
    assert got.shape == (T, rows)
    for t in range(T):  # each row of the batch is exactly the GEMV of that token
        one = torch.empty(rows)
        cpu.gemv([mat], X[t].contiguous(), [one])
        assert torch.equal(got[t], one)
    want = ref.gemm_ref(mat, X)
    bound = torch.stack([x_rounding_bound(mat, X[t]) for t in range(T)])
    assert torch.all((got.double() - want.double()).abs() <= bound)


def test_quantize_x_matches_reference(isa):
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal(256).astype(np.float32))
    x[32:64] = 0.0  # an all-zero block: d = 0, q = 0
    q, d, s = cpu.quantize_x(x)
    rq, rd, rs = ref.quantize_x_ref(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    torch.testing.assert_close(s, rs)


def test_quantize_xk_matches_reference(isa):
    """x in blocks of 128 (the K-quant kernels that sum half a super-block in integers): as the
    reference rounds it, an all-zero block and values halfway between two codes included (round
    to even), with the sums per 16 and the rounded x's sums per 32."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(1024).astype(np.float32) * 3)
    x[256:384] = 0.0
    x[384:512] = torch.arange(128) - 63.5  # d = 0.5: q = x / 0.5 lands on .5 where x is .25 off
    x[384] = 63.5  # amax 63.5: d exactly 0.5
    x[385:389] = torch.tensor([0.25, 0.75, -0.25, -1.25])
    q, d, bs, ks = cpu.quantize_xk(x)
    rq, rd, rbs = ref.quantize_xk_ref(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(bs, rbs)
    assert bs.dtype == torch.int16 and not q[256:384].any() and d[2] == 0
    assert d[3] == 0.5 and q[385:389].tolist() == [0, 2, 0, -2]
    sums32 = rq.to(torch.int32).reshape(-1, 32).sum(dim=1)
    assert torch.equal(ks, rd.repeat_interleave(4) * sums32.float())
    with pytest.raises(RuntimeError, match="quantize_xk"):
        cpu.quantize_xk(torch.zeros(96))


def test_gguf_file_tensors_are_used_in_place(tmp_path, threads):
    """Tensors read back from a GGUF file (read-only memmaps) go to the kernels uncopied."""
    rng = np.random.default_rng(3)
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    specs = {"a": ("Q4_0", 40, 256), "b": ("Q6_K", 9, 512)}
    for name, (t, rows, cols) in specs.items():
        raw = random_raw(t, rows, cols, rng).reshape(rows, -1)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        t, rows, cols = specs[tensor.name]
        raw = tensor.data.reshape(-1).view(np.uint8)
        assert np.shares_memory(raw, tensor.data) and not raw.flags.writeable
        mat = cpu.QuantMatrix(t, raw, rows, cols)
        assert mat.ptr == raw.__array_interface__["data"][0]
        x = torch.from_numpy(rng.standard_normal(cols).astype(np.float32))
        out, want = torch.empty(rows), torch.empty(rows)
        cpu.gemv([mat], x, [out])
        ref.gemv_q8_ref([mat], x, [want])
        assert torch.all((out.double() - want.double()).abs() <= summation_bound(mat, x))


def test_pool_sleeping_workers_and_thread_changes():
    """With no spinning, workers sleep between every call; results stay exact across thread
    counts."""
    rng = np.random.default_rng(4)
    # 1000 rows of 288 bytes: several chunks of >= 32 KiB
    mat = cpu.QuantMatrix("Q4_0", random_raw("Q4_0", 1000, 512, rng), 1000, 512)
    x = torch.from_numpy(rng.standard_normal(512).astype(np.float32))
    before = cpu.get_threads()
    first = torch.empty(1000)
    cpu.set_threads(1)
    cpu.gemv([mat], x, [first])
    try:
        for spin in (0, 50):
            cpu.set_spin_us(spin)
            for n in (2, 3, 1, 2):
                cpu.set_threads(n)
                assert cpu.get_threads() == n
                cpu.pool_stats(reset=True)
                for _ in range(20):
                    out = torch.full((1000,), float("nan"))
                    cpu.gemv([mat], x, [out])
                    assert torch.equal(out, first)
                caller, workers = cpu.pool_stats()
                if n > 1:  # every chunk ran exactly once, on one thread or the other
                    assert (caller + workers) % 20 == 0 and caller + workers >= 20 * n
    finally:
        cpu.set_spin_us(50)
        cpu.set_threads(before)


def test_errors_name_expected_and_found():
    raw = np.zeros(4 * 18, np.uint8)
    with pytest.raises(ValueError, match="expected 72 bytes, got 71"):
        cpu.QuantMatrix("Q4_0", raw[:71], 4, 32)
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu.QuantMatrix("Q4_K", np.zeros(144, np.uint8), 1, 128)
    with pytest.raises(ValueError, match="expected one of"):
        cpu.QuantMatrix("Q3_K", raw, 4, 32)
    mat = cpu.QuantMatrix("Q4_0", raw, 4, 32)
    with pytest.raises(ValueError, match=r"x: expected contiguous float32 \[32\]"):
        cpu.gemv([mat], torch.zeros(33), [torch.empty(4)])
    with pytest.raises(ValueError, match=r"x: expected contiguous float32 \[32\]"):
        cpu.gemv([mat], torch.zeros(64)[::2], [torch.empty(4)])  # strided
    with pytest.raises(ValueError, match=r"x: expected contiguous float32 \[32\]"):
        cpu.gemv([mat], torch.zeros(32, dtype=torch.float64), [torch.empty(4)])
    with pytest.raises(ValueError, match=r"outs\[0\]: expected contiguous float32 \[4\]"):
        cpu.gemv([mat], torch.zeros(32), [torch.empty(5)])
    with pytest.raises(ValueError, match="isa: expected one of"):
        cpu.set_isa("sse2")
    with pytest.raises(ValueError, match="threads: expected"):
        cpu.set_threads(0)


def test_missing_compiler_and_missing_library_say_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_build.BuildError, match="no C compiler found"):
        cpu_build.find_compiler()
    monkeypatch.setattr(cpu_build, "LIB", tmp_path / "libsicpu.so")
    with pytest.raises(cpu.CpuLibraryError, match="install.sh"):
        ops._load()


def test_compiler_flag_probe(tmp_path):
    """The build asks the compiler whether it takes -mavxvnni (the avx2_vnni variant is built as
    plain AVX2 where it does not): a flag every compiler here knows, and one none does."""
    cc = cpu_build.find_compiler()
    assert cpu_build._accepts(cc, "-mavx2", str(tmp_path))
    assert not cpu_build._accepts(cc, "-mno-such-flag-sparseinfer", str(tmp_path))


def test_best_isa_follows_the_cpu():
    """``best_isa`` against /proc/cpuinfo: AVX-512 with VNNI, else the 128-bit AVX2 variant on
    AMD Zen/Zen+ (family 23, models below 48) and Hygon (family 24), else AVX2 with AVX-VNNI,
    else AVX2."""
    info = Path("/proc/cpuinfo").read_text()
    field = lambda name: re.search(rf"^{name}\s*:\s*(.*)$", info, re.M).group(1).strip()  # noqa: E731
    vendor, family, model = field("vendor_id"), int(field("cpu family")), int(field("model"))
    flags = set(field("flags").split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        want = "avx512"
    elif (vendor == "AuthenticAMD" and family == 23 and model < 48) or (
            vendor == "HygonGenuine" and family == 24):
        want = "avx2_128"
    elif "avx_vnni" in flags:
        want = "avx2_vnni"
    else:
        want = "avx2"
    assert cpu.best_isa() == want
    assert want in cpu.available_isas()
