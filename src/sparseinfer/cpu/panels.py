"""Q4_0 / Q4_1 / Q8_0 / Q5_0 weights rearranged in panels of 16 rows for the C kernels (types
``Q4_0x16`` / ``Q4_1x16`` / ``Q8_0x16`` / ``Q5_0x16``; layout in ``qgemv.h``; Q5_0's fifth bits
transposed within their word): one integer dot product then
multiplies 4 bytes of the input with 4 weights of each of 16 rows, and the products stay in one
lane per row, so a GEMM over a few input rows does a third to half of the instructions of the
row-major kernels (a batched decode step, a prompt). The bytes per row are the file's; the
rearranged copy replaces the mapped rows (``models/build.py`` releases their pages).

    raw16 = to_panels(raw, "Q4_1", rows, cols)      # file rows -> panels (a new array, C)
    raw16 = to_panels_ref(raw, "Q4_1", rows, cols)  # the same in numpy
    raw = from_panels(raw16, "Q4_1", rows, cols)    # and back (the references decode that)
"""

from __future__ import annotations

import numpy as np

PANEL = 16  # rows per panel
# the file's type -> its panel type (cpu.TYPES)
PANEL_TYPES = {"Q4_0": "Q4_0x16", "Q4_1": "Q4_1x16", "Q8_0": "Q8_0x16", "Q5_0": "Q5_0x16"}
FILE_TYPES = {v: k for k, v in PANEL_TYPES.items()}
# fp16 words (scale, Q4_1's minimum) per block, block bytes; the rest are 4-byte quant words
_FIELDS = {"Q4_0": (1, 18), "Q4_1": (2, 20), "Q8_0": (1, 34), "Q5_0": (1, 22)}
# Q5_0's first 4-byte word (its 32 fifth bits) is stored transposed: bit 8k + s <- bit 4s + k
# (bit order within the little-endian word), so a shift lines up one quant word's bits
_BITS_T = np.array([4 * (b % 8) + b // 8 for b in range(32)])


def _transpose_bits(words: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Q5_0 fifth-bit words (uint8 [..., 4]) as the panels store them, or back."""
    bits = np.unpackbits(words, axis=-1, bitorder="little")
    if inverse:
        out = np.empty_like(bits)
        out[..., _BITS_T] = bits
    else:
        out = bits[..., _BITS_T]
    return np.packbits(out, axis=-1, bitorder="little")


def check_panel_shape(raw: np.ndarray, type_name: str, rows: int, cols: int
                      ) -> tuple[int, int, int]:
    """(scale words per row and block, block bytes, blocks per row) of a ``type_name`` matrix
    of ``rows`` x ``cols`` held in ``raw``; ValueError saying what was expected otherwise."""
    if type_name not in _FIELDS:
        raise ValueError(f"type: expected one of {list(_FIELDS)}, got {type_name!r}")
    if rows < 1 or rows % PANEL or cols < 32 or cols % 32:
        raise ValueError(f"{type_name} panels: expected rows a multiple of {PANEL} and cols of "
                         f"32, got rows={rows} cols={cols}")
    words, bsize = _FIELDS[type_name]
    nb = cols // 32
    if raw.size != rows * nb * bsize:
        raise ValueError(f"{type_name} [{rows}, {cols}]: expected {rows * nb * bsize} bytes, "
                         f"got {raw.size}")
    return words, bsize, nb


def to_panels(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    """The file's rows of ``type_name`` blocks (uint8, rows x row bytes) as panels, a new flat
    array, rearranged by the C library on its pool (``to_panels_ref``: the same in numpy)."""
    from .ops import to_panels as on_pool  # the library loads on first use

    return on_pool(raw, type_name, rows, cols)


def to_panels_ref(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    """``to_panels`` in numpy: per panel and block column, the 16 rows' scales (and Q4_1's
    minima), then their quant words (4 per Q4 block, 8 per Q8_0; Q5_0: its fifth-bit word,
    transposed, then 4), word by word."""
    words, bsize, nb = check_panel_shape(raw, type_name, rows, cols)
    nq = (bsize - 2 * words) // 4  # quant words per block
    blk = np.asarray(raw, dtype=np.uint8).reshape(rows // PANEL, PANEL, nb, bsize)
    scales = blk[..., : 2 * words].reshape(-1, PANEL, nb, words, 2)  # (P, 16, nb, words, 2)
    quants = blk[..., 2 * words :].reshape(-1, PANEL, nb, nq, 4)  # (P, 16, nb, word, 4)
    out = np.empty((rows // PANEL, nb, bsize * PANEL), dtype=np.uint8)
    if type_name == "Q5_0":
        quants = quants.copy()
        quants[..., 0, :] = _transpose_bits(quants[..., 0, :])
    out[..., : 2 * words * PANEL] = scales.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 2 * words * PANEL)
    out[..., 2 * words * PANEL :] = quants.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 64 * nq)
    return out.reshape(-1)


def from_panels(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    """``to_panels`` undone: the file's rows (uint8, rows x row bytes)."""
    words, bsize, nb = check_panel_shape(raw, type_name, rows, cols)
    nq = (bsize - 2 * words) // 4
    pan = np.asarray(raw, dtype=np.uint8).reshape(rows // PANEL, nb, bsize * PANEL)
    scales = pan[..., : 2 * words * PANEL].reshape(-1, nb, words, PANEL, 2)
    quants = pan[..., 2 * words * PANEL :].reshape(-1, nb, nq, PANEL, 4)
    out = np.empty((rows // PANEL, PANEL, nb, bsize), dtype=np.uint8)
    out[..., : 2 * words] = scales.transpose(0, 3, 1, 2, 4).reshape(-1, PANEL, nb, 2 * words)
    out[..., 2 * words :] = quants.transpose(0, 3, 1, 2, 4).reshape(-1, PANEL, nb, 4 * nq)
    if type_name == "Q5_0":
        out[..., 2:6] = _transpose_bits(out[..., 2:6], inverse=True)
    return out.reshape(rows, nb * bsize)
