"""4-bit block weights: ``w[r, 32·b + j] = scale[r, b] · q[r, 32·b + j] + offset[r, b]``.

This is llama.cpp's Q4_1 layout (Q4_0 is the case ``offset = -8 · scale``), kept as three plain
arrays so it can be read straight from a GGUF's blocks (no requantization: the quantized values
are the file's own) or made from float weights with Q4_1's rule. ``dequantize`` is the pure-torch
reference every 4-bit operator is tested against.

GGUF block layouts (ggml-common.h), 32 weights each, low nibbles first:
- Q4_0: ``d`` (fp16), 16 bytes of nibbles; ``w = d · (q − 8)``;
- Q4_1: ``d`` (fp16), ``m`` (fp16), 16 bytes of nibbles; ``w = d · q + m``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per block
BLOCK_BYTES = {"Q4_0": 2 + GROUP // 2, "Q4_1": 4 + GROUP // 2}
# K-quant super-blocks of 256 weights whose 32-weight sub-blocks map exactly onto these blocks
SUPER_BLOCK_BYTES = {"Q4_K": 144}
FILE_KINDS = (*BLOCK_BYTES, *SUPER_BLOCK_BYTES)  # GGUF types read as 4-bit blocks as they are


@dataclass(frozen=True)
class Q4Blocks:
    q: torch.Tensor  # (n, k) uint8, values 0..15
    scale: torch.Tensor  # (n, k // GROUP) float32
    offset: torch.Tensor  # (n, k // GROUP) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def rows(self, index: torch.Tensor) -> Q4Blocks:
        """The blocks of rows ``index`` (a row permutation or selection)."""
        return Q4Blocks(self.q[index], self.scale[index], self.offset[index])

    def dequantize(self) -> torch.Tensor:
        """The float32 weights ``(n, k)`` (reference)."""
        n, k = self.shape
        w = self.q.float().view(n, k // GROUP, GROUP) * self.scale[..., None]
        return (w + self.offset[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Stack row-wise (e.g. q, k and v into one fused projection)."""
        return Q4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.offset for p in parts]))


def check_shape(shape: tuple[int, ...], what: str) -> None:
    if len(shape) != 2 or shape[1] % GROUP:
        raise ValueError(f"{what}: expected a 2-D weight whose rows are a multiple of {GROUP} "
                         f"long, found shape {list(shape)}")


def from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Q4Blocks:
    """Blocks of a Q4_0 / Q4_1 / Q4_K GGUF tensor; ``raw`` its bytes, ``shape`` (rows, cols)."""
    if kind in SUPER_BLOCK_BYTES:
        return _from_q4_k(raw, shape)
    if kind not in BLOCK_BYTES:
        raise ValueError(f"expected a Q4_0, Q4_1 or Q4_K tensor, found {kind}")
    check_shape(shape, kind)
    n, k = shape
    nb, size = k // GROUP, BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if blocks.size != n * nb * size:
        raise ValueError(f"{kind} tensor of shape {list(shape)}: expected {n * nb * size} bytes, "
                         f"found {blocks.size}")
    from .int4pack import nibbles  # (numba: imported where it is first needed)

    q, d, m = nibbles(blocks.reshape(n, nb, size), kind == "Q4_1")  # low nibbles, then high
    d = d.astype(np.float32)
    m = -8.0 * d if m is None else m.astype(np.float32)
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def _from_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Q4Blocks:
    """Q4_K super-blocks (256 weights: fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit sub-block
    scales and mins, 128 bytes of nibbles) as 32-weight blocks: sub-block j of a super-block is
    ``w = d·sc_j · q − dmin·m_j``, i.e. scale ``d·sc_j`` and offset ``−dmin·m_j``; exact."""
    n, k = shape
    if len(shape) != 2 or k % 256:
        raise ValueError(f"Q4_K: expected a 2-D weight whose rows are a multiple of 256 long, "
                         f"found shape {list(shape)}")
    nsb = k // 256
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if b.size != n * nsb * 144:
        raise ValueError(f"Q4_K tensor of shape {list(shape)}: expected {n * nsb * 144} bytes, "
                         f"found {b.size}")
    b = b.reshape(n, nsb, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc = b[..., 4:16].astype(np.uint8)
    qs = b[..., 16:]  # (n, nsb, 128)
    scales = np.empty((n, nsb, 8), dtype=np.uint8)
    mins = np.empty((n, nsb, 8), dtype=np.uint8)
    scales[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scales[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    chunks = qs.reshape(n, nsb, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(n, k)
    scale = (d[..., None] * scales).reshape(n, nsb * 8)
    offset = (-dmin[..., None] * mins).reshape(n, nsb * 8)
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(scale.astype(np.float32)),
                    torch.from_numpy(offset.astype(np.float32)))


def quantize(w: torch.Tensor) -> Q4Blocks:
    """Q4_1's rule on float weights: per block ``offset = min``, ``scale = (max − min) / 15``,
    ``q = round((w − offset) / scale)`` (as llama.cpp's ``quantize_row_q4_1``)."""
    check_shape(tuple(w.shape), "quantize")
    n, k = w.shape
    blk = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = blk.amin(-1), blk.amax(-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = ((blk - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Q4Blocks(q.reshape(n, k), scale.contiguous(), lo.contiguous())
