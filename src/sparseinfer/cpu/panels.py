"""Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K weights rearranged in panels of 16 rows
for the C kernels (types ``Q4_0x16`` ... ``Q5_1x16``; layout in ``qgemv.h``; Q5_0/Q5_1's fifth bits
transposed within their word; Q4_K/Q5_K's six-bit scales and minima regrouped, each sub-block of
32 a block to the kernels; Q6_K's scales row by row; and in ``Q6_Kx16b`` / ``Q5_Kx16b`` the
six- / five-bit weights byte-aligned, three words holding four / five holding eight, the
layouts plain AVX2 unpacks fastest, ``panel_type``): one integer dot product then
multiplies 4 bytes of the input with 4 weights of each of 16 rows, and the products stay in one
lane per row, so a GEMM over a few input rows does a third to half of the instructions of the
row-major kernels (a batched decode step, a prompt). The bytes per row are the file's; the
rearranged copy replaces the mapped rows (``models/build.py`` releases their pages).

    raw16 = to_panels(raw, "Q4_1", rows, cols)      # file rows -> panels (a new array, C)
    raw16 = to_panels_ref(raw, "Q4_1", rows, cols)  # the same in numpy
    raw = from_panels(raw16, "Q4_1", rows, cols)    # and back (the references decode that)
    to_panels(raw, "Q6_K", rows, cols, panel_type("Q6_K", "avx2"))  # "Q6_Kx16b"
"""

from __future__ import annotations

import numpy as np

PANEL = 16  # rows per panel
# the file's type -> its panel type (cpu.TYPES)
PANEL_TYPES = {"Q4_0": "Q4_0x16", "Q4_1": "Q4_1x16", "Q8_0": "Q8_0x16", "Q5_0": "Q5_0x16",
               "Q4_K": "Q4_Kx16", "Q5_K": "Q5_Kx16", "Q6_K": "Q6_Kx16", "Q5_1": "Q5_1x16"}
# Q6_K's and Q5_K's other layouts (byte-aligned weights; every ISA's kernels take both)
FILE_TYPES = {**{v: k for k, v in PANEL_TYPES.items()}, "Q6_Kx16b": "Q6_K", "Q5_Kx16b": "Q5_K"}
# fp16 words (scale, Q4_1's minimum) per block, block bytes; the rest are 4-byte quant words
_FIELDS = {"Q4_0": (1, 18), "Q4_1": (2, 20), "Q8_0": (1, 34), "Q5_0": (1, 22), "Q5_1": (2, 24),
           "Q4_K": (2, 144), "Q5_K": (2, 176), "Q6_K": (1, 210)}
_ELEMS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # weights per block (32 for the others)
# Q5_0/Q5_1's first 4-byte word (its 32 fifth bits) is stored transposed: bit 8k + s <- bit 4s + k
# (bit order within the little-endian word), so a shift lines up one quant word's bits
_BITS_T = np.array([4 * (b % 8) + b // 8 for b in range(32)])


def _transpose_bits(words: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Q5_0/Q5_1 fifth-bit words (uint8 [..., 4]) as the panels store them, or back."""
    bits = np.unpackbits(words, axis=-1, bitorder="little")
    if inverse:
        out = np.empty_like(bits)
        out[..., _BITS_T] = bits
    else:
        out = bits[..., _BITS_T]
    return np.packbits(out, axis=-1, bitorder="little")


def panel_type(type_name: str, isa: str) -> str | None:
    """The panel type the kernels of ``isa`` (``cpu.ISAS``) read fastest for a matrix of
    ``type_name`` (None: no panel layout): ``PANEL_TYPES``', except Q6_K and Q5_K off AVX-512,
    whose 256-bit kernels unpack the byte-aligned weights of ``Q6_Kx16b`` / ``Q5_Kx16b`` with
    a third fewer operations (benchmarks/RESULTS.md)."""
    if type_name in ("Q6_K", "Q5_K") and isa != "avx512":
        return type_name + "x16b"
    return PANEL_TYPES.get(type_name)


def _panel_of(type_name: str, panel: str | None) -> str:
    """``panel`` (default: ``type_name``'s in ``PANEL_TYPES``) checked to be a panel type of
    ``type_name``."""
    if type_name not in PANEL_TYPES:
        raise ValueError(f"type: expected one of {list(PANEL_TYPES)}, got {type_name!r}")
    panel = PANEL_TYPES[type_name] if panel is None else panel
    if FILE_TYPES.get(panel) != type_name:
        kinds = [k for k, v in FILE_TYPES.items() if v == type_name]
        raise ValueError(f"panel type of {type_name}: expected one of {kinds}, got {panel!r}")
    return panel


def check_panel_shape(raw: np.ndarray, type_name: str, rows: int, cols: int
                      ) -> tuple[int, int, int]:
    """(scale words per row and block, block bytes, blocks per row) of a ``type_name`` matrix
    of ``rows`` x ``cols`` held in ``raw``; ValueError saying what was expected otherwise."""
    if type_name not in _FIELDS:
        raise ValueError(f"type: expected one of {list(_FIELDS)}, got {type_name!r}")
    elems = _ELEMS.get(type_name, 32)
    if rows < 1 or rows % PANEL or cols < elems or cols % elems:
        raise ValueError(f"{type_name} panels: expected rows a multiple of {PANEL} and cols of "
                         f"{elems}, got rows={rows} cols={cols}")
    words, bsize = _FIELDS[type_name]
    nb = cols // elems
    if raw.size != rows * nb * bsize:
        raise ValueError(f"{type_name} [{rows}, {cols}]: expected {rows * nb * bsize} bytes, "
                         f"got {raw.size}")
    return words, bsize, nb


def to_panels(raw: np.ndarray, type_name: str, rows: int, cols: int,
              panel: str | None = None) -> np.ndarray:
    """The file's rows of ``type_name`` blocks (uint8, rows x row bytes) as panels of type
    ``panel`` (default ``PANEL_TYPES[type_name]``), a new flat array, rearranged by the C library
    on its pool (``to_panels_ref``: the same in numpy)."""
    from .ops import to_panels as on_pool  # the library loads on first use

    return on_pool(raw, type_name, rows, cols, _panel_of(type_name, panel))


def to_panels_ref(raw: np.ndarray, type_name: str, rows: int, cols: int,
                  panel: str | None = None) -> np.ndarray:
    """``to_panels`` in numpy: per panel and block column, the 16 rows' scales (and Q4_1's
    minima), then their quant words (4 per Q4 block, 8 per Q8_0; Q5_0/Q5_1: its fifth-bit word,
    transposed, then 4), word by word; the K-quants as qgemv.h lays them out."""
    panel = _panel_of(type_name, panel)
    words, bsize, nb = check_panel_shape(raw, type_name, rows, cols)
    blk = np.asarray(raw, dtype=np.uint8).reshape(rows // PANEL, PANEL, nb, bsize)
    if panel == "Q6_Kx16b":
        return _q6kb_to_panels(blk)
    if panel == "Q5_Kx16b":
        return _q5kb_to_panels(blk)
    if type_name == "Q6_K":
        return _q6k_to_panels(blk)
    if type_name in _ELEMS:
        return _k45_to_panels(blk)
    nq = (bsize - 2 * words) // 4  # quant words per block
    scales = blk[..., : 2 * words].reshape(-1, PANEL, nb, words, 2)  # (P, 16, nb, words, 2)
    quants = blk[..., 2 * words :].reshape(-1, PANEL, nb, nq, 4)  # (P, 16, nb, word, 4)
    out = np.empty((rows // PANEL, nb, bsize * PANEL), dtype=np.uint8)
    if type_name in ("Q5_0", "Q5_1"):
        quants = quants.copy()
        quants[..., 0, :] = _transpose_bits(quants[..., 0, :])
    out[..., : 2 * words * PANEL] = scales.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 2 * words * PANEL)
    out[..., 2 * words * PANEL :] = quants.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 64 * nq)
    return out.reshape(-1)


def from_panels(raw: np.ndarray, type_name: str, rows: int, cols: int,
                panel: str | None = None) -> np.ndarray:
    """``to_panels`` undone: the file's rows (uint8, rows x row bytes)."""
    panel = _panel_of(type_name, panel)
    words, bsize, nb = check_panel_shape(raw, type_name, rows, cols)
    pan = np.asarray(raw, dtype=np.uint8).reshape(rows // PANEL, nb, bsize * PANEL)
    if panel == "Q6_Kx16b":
        return _q6kb_from_panels(pan, rows)
    if panel == "Q5_Kx16b":
        return _q5kb_from_panels(pan, rows)
    if type_name == "Q6_K":
        return _q6k_from_panels(pan, rows)
    if type_name in _ELEMS:
        return _k45_from_panels(pan, rows)
    nq = (bsize - 2 * words) // 4
    scales = pan[..., : 2 * words * PANEL].reshape(-1, nb, words, PANEL, 2)
    quants = pan[..., 2 * words * PANEL :].reshape(-1, nb, nq, PANEL, 4)
    out = np.empty((rows // PANEL, PANEL, nb, bsize), dtype=np.uint8)
    out[..., : 2 * words] = scales.transpose(0, 3, 1, 2, 4).reshape(-1, PANEL, nb, 2 * words)
    out[..., 2 * words :] = quants.transpose(0, 3, 1, 2, 4).reshape(-1, PANEL, nb, 4 * nq)
    if type_name in ("Q5_0", "Q5_1"):
        h = slice(2 * words, 2 * words + 4)  # the fifth-bit word
        out[..., h] = _transpose_bits(out[..., h], inverse=True)
    return out.reshape(rows, nb * bsize)


def _k_fields(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K / Q5_K block's 12 scale bytes (uint8 [..., 12]) -> its 8 six-bit scales and its 8
    minima."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _k_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``_k_fields`` undone: the 12 scale bytes."""
    a = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    c = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def _k45_to_panels(blk: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K blocks (P, 16 rows, nsb, 144 / 176) -> Q4_Kx16 / Q5_Kx16 panels, flat (layout
    in qgemv.h)."""
    P, _, nsb, bsize = blk.shape
    out = np.empty((P, nsb, 16 * bsize), dtype=np.uint8)
    out[..., :64] = blk[..., :4].reshape(P, PANEL, nsb, 2, 2).transpose(0, 2, 3, 1, 4).reshape(
        P, nsb, 64)  # d x 16, then dmin x 16
    for (off, hoff), f in zip(((64, 192), (128, 224)), _k_fields(blk[..., 4:16])):
        lo = (f[..., :4] & 15) | ((f[..., 4:] & 15) << 4)  # (P, 16, nsb, 4)
        out[..., off:off + 64] = lo.transpose(0, 2, 3, 1).reshape(P, nsb, 64)
        hi = sum(((f[..., j].astype(np.uint16) >> 4) & 3) << (2 * j) for j in range(8))
        out[..., hoff:hoff + 32] = np.ascontiguousarray(
            hi.astype("<u2").transpose(0, 2, 1)).view(np.uint8).reshape(P, nsb, 32)
    if bsize == 176:  # Q5_K's fifth bits: 8 words
        out[..., 256:768] = blk[..., 16:48].reshape(P, PANEL, nsb, 8, 4).transpose(
            0, 2, 3, 1, 4).reshape(P, nsb, 512)
    quants = blk[..., bsize - 128:].reshape(P, PANEL, nsb, 32, 4).transpose(0, 2, 3, 1, 4)
    out[..., 16 * bsize - 2048:] = quants.reshape(P, nsb, 2048)
    return out.reshape(-1)


def _k45_from_panels(pan: np.ndarray, rows: int) -> np.ndarray:
    """``_k45_to_panels`` undone: the file's rows (uint8, rows x row bytes)."""
    P, nsb, pbytes = pan.shape
    bsize = pbytes // PANEL
    out = np.empty((P, PANEL, nsb, bsize), dtype=np.uint8)
    out[..., :4] = pan[..., :64].reshape(P, nsb, 2, PANEL, 2).transpose(0, 3, 1, 2, 4).reshape(
        P, PANEL, nsb, 4)
    fields = []
    for off, hoff in ((64, 192), (128, 224)):
        lo = pan[..., off:off + 64].reshape(P, nsb, 4, PANEL).transpose(0, 3, 1, 2)  # (P,16,nsb,4)
        hi = np.ascontiguousarray(pan[..., hoff:hoff + 32]).view("<u2").reshape(
            P, nsb, PANEL).transpose(0, 2, 1)  # (P, 16, nsb)
        top = np.stack([(hi >> (2 * j)) & 3 for j in range(8)], axis=-1).astype(np.uint8) << 4
        fields.append(np.concatenate([lo & 15, lo >> 4], axis=-1) | top)
    out[..., 4:16] = _k_bytes(*fields)
    if bsize == 176:
        out[..., 16:48] = pan[..., 256:768].reshape(P, nsb, 8, PANEL, 4).transpose(
            0, 3, 1, 2, 4).reshape(P, PANEL, nsb, 32)
    out[..., bsize - 128:] = pan[..., pbytes - 2048:].reshape(P, nsb, 32, PANEL, 4).transpose(
        0, 3, 1, 2, 4).reshape(P, PANEL, nsb, 128)
    return out.reshape(rows, nsb * bsize)


# Q6_K's block: ql [0, 128), qh [128, 192), 16 int8 scales [192, 208), d [208, 210); its panel:
# d x 16, scales (scale i of the 16 rows), qh words, ql words (qgemv.h)
_Q6_PARTS = ((208, 210, 2, 0), (192, 208, 1, 32), (128, 192, 4, 288), (0, 128, 4, 1312))


def _q6k_to_panels(blk: np.ndarray, parts: tuple = _Q6_PARTS) -> np.ndarray:
    """Q6_K blocks (P, 16 rows, nsb, 210) -> Q6_Kx16 panels, flat (layout in qgemv.h); only
    ``parts`` of them (the rest left unset)."""
    P, _, nsb, _ = blk.shape
    out = np.empty((P, nsb, 3360), dtype=np.uint8)
    for lo, hi, unit, off in parts:  # each part's units (bytes or words) row-interleaved
        n = (hi - lo) // unit
        part = blk[..., lo:hi].reshape(P, PANEL, nsb, n, unit).transpose(0, 2, 3, 1, 4)
        out[..., off:off + PANEL * (hi - lo)] = part.reshape(P, nsb, -1)
    return out.reshape(-1)


def _q6k_from_panels(pan: np.ndarray, rows: int, parts: tuple = _Q6_PARTS) -> np.ndarray:
    """``_q6k_to_panels`` undone: the file's rows (uint8, rows x row bytes); only ``parts``."""
    P, nsb, _ = pan.shape
    out = np.empty((P, PANEL, nsb, 210), dtype=np.uint8)
    for lo, hi, unit, off in parts:
        n = (hi - lo) // unit
        part = pan[..., off:off + PANEL * (hi - lo)].reshape(P, nsb, n, PANEL, unit)
        out[..., lo:hi] = part.transpose(0, 3, 1, 2, 4).reshape(P, PANEL, nsb, hi - lo)
    return out.reshape(rows, nsb * 210)


# Q6_K's 256 six-bit codes in element order n: the low nibble is ql byte 64h + 32(g % 2) + l's
# (high half for g >= 2), the top bits qh byte 32h + l's bits 2g, 2g + 1 (h = n // 128, g = n %
# 128 // 32, l = n % 32)
_N = np.arange(256)
_Q6_QL = 64 * (_N // 128) + 32 * (_N % 128 // 32 % 2) + _N % 32
_Q6_QH = 128 + 32 * (_N // 128) + _N % 32
_Q6_LO_SHIFT = 4 * (_N % 128 // 64)
_Q6_HI_SHIFT = 2 * (_N % 128 // 32)


def _q6kb_to_panels(blk: np.ndarray) -> np.ndarray:
    """Q6_K blocks (P, 16 rows, nsb, 210) -> Q6_Kx16b panels, flat (layout in qgemv.h): d and
    the scales as Q6_Kx16, then per sub-block i three words of 16 rows x 4 bytes, byte e of word
    m = weight 16i + 4m + e | bits 2m, 2m + 1 of weight 16i + 12 + e << 6."""
    P, _, nsb, _ = blk.shape
    lo = (blk[..., _Q6_QL] >> _Q6_LO_SHIFT) & 15
    codes = lo | (((blk[..., _Q6_QH] >> _Q6_HI_SHIFT) & 3) << 4)
    w = codes.reshape(P, PANEL, nsb, 16, 4, 4)  # (P, r, nsb, i, word c, e)
    top = np.stack([(w[..., 3, :] >> (2 * m)) & 3 for m in range(3)], axis=-2)  # (.., i, m, e)
    words = (w[..., :3, :] | (top << 6)).astype(np.uint8)
    out = _q6k_to_panels(blk, _Q6_PARTS[:2]).reshape(P, nsb, 3360)  # d and the scales
    out[..., 288:] = words.transpose(0, 2, 3, 4, 1, 5).reshape(P, nsb, -1)  # (P, nsb, i, m, r, e)
    return out.reshape(-1)


def _q6kb_from_panels(pan: np.ndarray, rows: int) -> np.ndarray:
    """``_q6kb_to_panels`` undone: the file's rows (uint8, rows x row bytes)."""
    P, nsb, _ = pan.shape
    out = _q6k_from_panels(pan, rows, _Q6_PARTS[:2]).reshape(P, PANEL, nsb, 210)  # d, scales
    words = pan[..., 288:].reshape(P, nsb, 16, 3, PANEL, 4).transpose(0, 4, 1, 2, 3, 5)
    fourth = sum(((words[..., m, :] >> 6) & 3) << (2 * m) for m in range(3))
    codes = np.concatenate([words & 63, fourth[..., None, :]], axis=-2).reshape(P, PANEL, nsb, 256)
    ql = _or_bits(codes & 15, _Q6_QL, _Q6_LO_SHIFT, 128)
    qh = _or_bits(codes >> 4, _Q6_QH - 128, _Q6_HI_SHIFT, 64)
    out[..., :128], out[..., 128:192] = ql, qh
    return out.reshape(rows, nsb * 210)


def _or_bits(values: np.ndarray, index: np.ndarray, shift: np.ndarray, n: int) -> np.ndarray:
    """Bytes [..., n] with ``values[..., k] << shift[k]`` or-ed into byte ``index[k]`` (the
    elements of one shift land on distinct bytes)."""
    out = np.zeros(values.shape[:-1] + (n,), dtype=np.uint8)
    for sh in np.unique(shift):
        sel = shift == sh
        out[..., index[sel]] |= (values[..., sel] << sh).astype(np.uint8)
    return out


# Q5_K's 256 five-bit codes in element order n: the low nibble is qs byte 32(n // 64) + n % 32's
# (high half for n % 64 >= 32), the fifth bit qh byte n % 32's bit n // 32 (qs at 48, qh at 16)
_Q5_QS = 48 + 32 * (_N // 64) + _N % 32
_Q5_QH = 16 + _N % 32
_Q5_LO_SHIFT = 4 * (_N % 64 // 32)
_Q5_HI_SHIFT = _N // 32


def _q5kb_to_panels(blk: np.ndarray) -> np.ndarray:
    """Q5_K blocks (P, 16 rows, nsb, 176) -> Q5_Kx16b panels, flat (layout in qgemv.h): Q5_Kx16's
    first 256 bytes, then per sub-block j five words of 16 rows x 4 bytes, byte e of word m =
    weight 32j + 4m + e | bits 3m .. 3m + 2 of t << 5 (t: weights 32j + 20 + e, 24 + e, 28 + e
    as 5-bit fields)."""
    P, _, nsb, _ = blk.shape
    lo = (blk[..., _Q5_QS] >> _Q5_LO_SHIFT) & 15
    codes = (lo | (((blk[..., _Q5_QH] >> _Q5_HI_SHIFT) & 1) << 4)).astype(np.int64)
    w = codes.reshape(P, PANEL, nsb, 8, 8, 4)  # (P, r, nsb, j, word c, e)
    t = w[..., 5, :] | (w[..., 6, :] << 5) | (w[..., 7, :] << 10)  # (.., j, e)
    top = np.stack([(t >> (3 * m)) & 7 for m in range(5)], axis=-2)  # (.., j, m, e)
    words = (w[..., :5, :] | (top << 5)).astype(np.uint8)
    out = _k45_to_panels(blk).reshape(P, nsb, 2816)  # d, dmin, scales, minima: bytes 0-255
    out[..., 256:] = words.transpose(0, 2, 3, 4, 1, 5).reshape(P, nsb, -1)  # (P, nsb, j, m, r, e)
    return out.reshape(-1)


def _q5kb_from_panels(pan: np.ndarray, rows: int) -> np.ndarray:
    """``_q5kb_to_panels`` undone: the file's rows (uint8, rows x row bytes)."""
    P, nsb, _ = pan.shape
    out = _k45_from_panels(pan, rows).reshape(P, PANEL, nsb, 176)  # d, dmin, scales, minima
    words = pan[..., 256:].reshape(P, nsb, 8, 5, PANEL, 4).transpose(0, 4, 1, 2, 3, 5)
    t = sum(((words[..., m, :].astype(np.int64) >> 5) & 7) << (3 * m) for m in range(5))
    last = np.stack([(t >> (5 * k)) & 31 for k in range(3)], axis=-2)  # words 5, 6, 7
    codes = np.concatenate([words & 31, last], axis=-2).reshape(P, PANEL, nsb, 256)
    out[..., 48:] = _or_bits(codes & 15, _Q5_QS - 48, _Q5_LO_SHIFT, 128)
    out[..., 16:48] = _or_bits(codes >> 4, _Q5_QH - 16, _Q5_HI_SHIFT, 32)
    return out.reshape(rows, nsb * 176)
