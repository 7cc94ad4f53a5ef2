"""Neuron-bundled FFN weights: one active neuron is one contiguous read.

``PackedFFN.rows`` is ``[d_ff, n_mats, d_model]``: for neuron i, ``rows[i]`` holds its gate row
(gated kinds only), its up row and its down column (the down projection stored transposed), back
to back (LLM-in-a-Flash "row-column bundling"). Storage is fp32, bf16, int8 or q4; int8 rows carry
float32 symmetric absmax scales per block of ``block`` consecutive weights of one row
(``block == d_model`` means one scale per row; a last block shorter than ``block`` is allowed).
q4 rows hold GGUF Q4_0's numbers (per block of 32 weights an fp16 scale ``d`` and 16 bytes of
nibbles, ``w = d · (q − 8)``) split by kind: a row's nb = d_model / 32 scales first, then its
blocks' quant bytes (``q4_rows``), so ``rows`` is uint8 ``[d_ff, n_mats, d_model / 32 · 18]``;
they run in the C kernel ``sparseinfer.cpu.sparse_ffn_q4`` (int8 rows with blocks a multiple of 8 in
``sparse_ffn_i8``, other storage in numba: ``kernels.py``).

int8 bundles of a ReLU gate (ReGLU, dReLU) may hold their gate rows apart as q4 rows instead
(``gates``, uint8 ``[d_ff, d_model / 32 · 18]``: a file's Q4_0 gate rows, its own numbers; the
bundles then hold the up and down rows alone, ``rows`` ``[d_ff, 2, d_model]``): the C kernels
take the gates from those rows — half the bytes of an int8 gate row, and most selected neurons
of a ReLU model do not fire, so that is most of what they read — and read a neuron's int8 rows
where its gate fired. ``rows_fp32`` and everything built on it see the three matrices.

Dtype "q4i8" goes one step further for a file whose up rows are Q4_0 too: the gates apart as
above, and each neuron's bundle (``rows`` uint8 ``[d_ff, 1, q4i8_layout(...).width]``) holds
its down row's float32 scales (one per ``block``), its up row as a q4 row (the file's numbers),
then its int8 down row — one contiguous read of 3/4 of an int8 up-and-down bundle's bytes and
scales where a gate fired (benchmarks/RESULTS.md). ``scales`` is None: they are in the bundles.

The kernels (``kernels.py``) and the torch references (``reference.py``) read only this layout.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..config import FFN_KINDS
from ..fileio import libc

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                                   "q4": torch.uint8, "q4i8": torch.uint8}
INT8_MAX = 127.0
INT8_BLOCK = 32  # weights per scale in the int8 bundles a model is built with


def int8_block(d_model: int) -> int:
    """The scale block of a model's int8 bundles: ``INT8_BLOCK`` weights, or the whole row when
    ``d_model`` is not a multiple of it. (One scale per row cost SmolLM2 perplexity, the down
    projection's transposed columns having outliers: benchmarks/RESULTS.md.)"""
    return INT8_BLOCK if d_model % INT8_BLOCK == 0 else d_model
Q4_GROUP, Q4_BYTES = 32, 18  # Q4_0: weights and bytes per block


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks of the rows of ``w`` ``[..., d]`` (d a multiple of 32), as ggml's
    ``quantize_row_q4_0``: ``d = x[argmax |x|] / -8``, ``q = min(15, trunc(x / d + 8.5))``;
    returns uint8 ``[..., d / 32 · 18]`` (fp16 ``d``, then byte j = q[j] | q[j + 16] << 4)."""
    *lead, d = w.shape
    if d % Q4_GROUP:
        raise ValueError(f"q4: expected rows a multiple of {Q4_GROUP} long, got {d}")
    blk = w.detach().float().reshape(*lead, d // Q4_GROUP, Q4_GROUP)
    imax = blk.abs().argmax(dim=-1, keepdim=True)
    scale = torch.gather(blk, -1, imax) / -8.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.trunc(blk * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    d16 = scale.to(torch.float16).view(torch.uint8)  # [..., nb, 2]
    return torch.cat([d16, packed], dim=-1).reshape(*lead, d // Q4_GROUP * Q4_BYTES)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., d]`` of Q4_0 rows ``raw`` uint8 ``[..., d / 32 · 18]`` (the reference)."""
    *lead, width = raw.shape
    blk = raw.reshape(*lead, width // Q4_BYTES, Q4_BYTES)
    scale = blk[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    qs = blk[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float() - 8.0
    return (q * scale).reshape(*lead, width // Q4_BYTES * Q4_GROUP)


def q4_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows ``blocks`` (uint8 ``[..., nb · 18]``) as q4 rows, the same bytes split by kind:
    the nb fp16 scales (block b's at byte 2b), then the nb × 16 quant bytes (block b's at
    2nb + 16b). The kernels (cpu/kernels.c) load a row's scales 8 blocks at a time, and its
    quants without Q4_0's 18-byte blocks crossing cache lines."""
    *lead, width = blocks.shape
    nb = width // Q4_BYTES
    blk = blocks.reshape(*lead, nb, Q4_BYTES)
    return torch.cat([blk[..., :2].reshape(*lead, 2 * nb), blk[..., 2:].reshape(*lead, 16 * nb)],
                     dim=-1)


def q4_blocks(rows: torch.Tensor) -> torch.Tensor:
    """The Q4_0 rows of q4 rows ``rows`` (``q4_rows``' inverse)."""
    *lead, width = rows.shape
    nb = width // Q4_BYTES
    d = rows[..., : 2 * nb].reshape(*lead, nb, 2)
    q = rows[..., 2 * nb :].reshape(*lead, nb, 16)
    return torch.cat([d, q], dim=-1).reshape(*lead, width)


def quantize_q4_rows(w: torch.Tensor) -> torch.Tensor:
    """q4 rows of the rows of ``w`` ``[..., d]``: ``quantize_q4_0``'s blocks as ``q4_rows``."""
    return q4_rows(quantize_q4_0(w))


def dequantize_q4_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., d]`` of q4 rows (uint8 ``[..., d / 32 · 18]``; the reference)."""
    return dequantize_q4_0(q4_blocks(rows))


@dataclass(frozen=True)
class Q4i8Layout:
    """Byte offsets in one neuron's bundle of dtype "q4i8": the down row's float32 scales at 0,
    the up row's q4 row at ``up``, the int8 down row at ``down``; ``width`` bytes from one
    bundle to the next (rounded up to 4: every bundle's scales aligned). The C kernels compute
    the same (``si_q4u_bytes`` in cpu/qgemv.h)."""

    up: int
    down: int
    width: int


def q4i8_layout(d_model: int, block: int) -> Q4i8Layout:
    """The layout of a "q4i8" bundle of ``d_model`` weights a row, scales per ``block``."""
    up = 4 * n_blocks(d_model, block)
    down = up + d_model // Q4_GROUP * Q4_BYTES
    return Q4i8Layout(up, down, -(-(down + d_model) // 4) * 4)


def q4i8_empty(d_ff: int, d_model: int, block: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bundles of dtype "q4i8" to fill (uint8 ``[d_ff, 1, width]``, in huge pages, the padding
    zeroed) and views of their parts: the q4 up rows (uint8 ``[d_ff, d_model / 32 · 18]``), the
    int8 down rows ``[d_ff, d_model]`` and their float32 scales ``[d_ff, ceil(d_model /
    block)]`` — each a row a bundle apart, so the loader writes them in place."""
    lay = q4i8_layout(d_model, block)
    rows = empty_hugepages((d_ff, 1, lay.width), torch.uint8)
    b = rows[:, 0]
    b[:, lay.down + d_model :] = 0
    return (rows, b[:, lay.up : lay.down], b[:, lay.down : lay.down + d_model].view(torch.int8),
            b[:, : lay.up].view(torch.float32))


def q4i8_rows(ups: torch.Tensor, down: torch.Tensor, down_scales: torch.Tensor,
              block: int) -> torch.Tensor:
    """Bundles of dtype "q4i8" (uint8 ``[d_ff, 1, width]``, in huge pages) of q4 up rows ``ups``
    (uint8 ``[d_ff, d_model / 32 · 18]``), int8 down rows ``down`` ``[d_ff, d_model]`` and their
    float32 scales ``down_scales`` ``[d_ff, ceil(d_model / block)]``."""
    d_ff, d_model = down.shape
    want = {"ups": (ups, torch.uint8, (d_ff, d_model // Q4_GROUP * Q4_BYTES)),
            "down": (down, torch.int8, (d_ff, d_model)),
            "down_scales": (down_scales, torch.float32, (d_ff, n_blocks(d_model, block)))}
    for name, (t, dtype, shape) in want.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected {str(dtype).removeprefix('torch.')} {shape}, got "
                             f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}")
    rows, *parts = q4i8_empty(d_ff, d_model, block)
    for part, t in zip(parts, (ups, down, down_scales)):
        part.copy_(t)
    return rows


HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


def empty_hugepages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` whose memory is 2 MiB-aligned and advised for transparent huge pages.

    The kernels jump between neurons: with 4 KiB pages each neuron's bundle costs several TLB
    misses, with 2 MiB pages almost none (measured +10-20% on sparse FFN bandwidth). Linux only,
    best effort (THP in "madvise" mode, the usual default); elsewhere a plain ``torch.empty``.
    """
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    lib = libc()
    if lib is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # large: fresh, untouched pages
    off = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[off : off + nbytes]
    if lib.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE):
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return buf.view(dtype).view(shape)


def _select_rows(t: torch.Tensor, neurons: torch.Tensor) -> torch.Tensor:
    """Rows ``neurons`` of ``t`` into a new tensor in huge pages."""
    out = empty_hugepages((neurons.numel(), *t.shape[1:]), t.dtype)
    return torch.index_select(t, 0, neurons, out=out)


def n_blocks(d_model: int, block: int) -> int:
    """Number of int8 scale blocks per row (the last one may be short)."""
    return -(-d_model // block)


def expand_scales(scales: torch.Tensor, block: int, d_model: int) -> torch.Tensor:
    """``[..., n_blocks]`` per-block scales → ``[..., d_model]`` per-weight scales."""
    return scales.repeat_interleave(block, dim=-1)[..., :d_model]


def quantize_int8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over blocks of the last dim: ``w ≈ q * expand_scales(s)``.

    w: ``[..., d]`` float; returns ``q`` int8 ``[..., d]``, ``s`` float32 ``[..., ceil(d/block)]``.
    """
    d = w.shape[-1]
    nb = n_blocks(d, block)
    pad = nb * block - d
    wf = w.float()
    if pad:
        wf = torch.nn.functional.pad(wf, (0, pad))
    wb = wf.reshape(*wf.shape[:-1], nb, block)
    scale = wb.abs().amax(dim=-1) / INT8_MAX  # [..., nb]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wb / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    q = q.reshape(*wf.shape[:-1], nb * block)[..., :d].contiguous()
    return q, scale.contiguous()


@dataclass(frozen=True, eq=False)
class PackedFFN:
    """One FFN layer's weights bundled per neuron (see the module docstring)."""

    kind: str  # key of FFN_KINDS
    dtype: str  # a key of DTYPES: "fp32" | "bf16" | "int8" | "q4" | "q4i8"
    d_model: int
    d_ff: int
    rows: torch.Tensor  # [d_ff, n_mats, d_model]; n_mats = 3 (gate, up, down_t) or 2 (up, down_t)
    # (gates apart: [d_ff, stored_mats = 2, d_model]; q4i8: uint8 [d_ff, 1, bundle bytes])
    scales: torch.Tensor | None = None  # int8: [d_ff, stored_mats, ceil(d_model / block)] float32
    block: int = 0  # int8 scale block size (d_model = per row); 0 if not int8
    up_bias: torch.Tensor | None = None  # [d_ff] fp32 (ungated MLPs); None = no bias
    gates: torch.Tensor | None = None  # int8, ReLU gate: the gate rows apart, as q4 rows
    # Per-object cache for the kernels (numpy views, dense copies); not part of the value.
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in FFN_KINDS:
            raise ValueError(f"kind: expected one of {sorted(FFN_KINDS)}, got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "q4" and self.d_model % Q4_GROUP:
            raise ValueError(f"d_model: expected a multiple of {Q4_GROUP} for q4, got "
                             f"{self.d_model}")
        if self.dtype == "q4i8" and self.gates is None:
            raise ValueError("gates: expected the q4 gate rows apart for dtype 'q4i8', got None")
        if self.gates is not None:
            kind = FFN_KINDS[self.kind]
            if self.dtype not in ("int8", "q4i8") or not kind.gated or kind.gate_act != "relu":
                raise ValueError(f"gates: q4 gate rows apart expected only for int8 bundles of a "
                                 f"ReLU gate, got {self.dtype} rows of kind {self.kind!r}")
            want_g = (self.d_ff, self.d_model // Q4_GROUP * Q4_BYTES)
            if self.block % Q4_GROUP:  # the kernels take x rounded per 32 for both
                raise ValueError(f"gates: expected int8 scale blocks a multiple of {Q4_GROUP} "
                                 f"with q4 gate rows, got {self.block}")
            if (self.d_model % Q4_GROUP or self.gates.dtype != torch.uint8
                    or tuple(self.gates.shape) != want_g or not self.gates.is_contiguous()):
                raise ValueError(f"gates: expected contiguous uint8 {want_g} (d_model a multiple "
                                 f"of {Q4_GROUP}), got {self.gates.dtype} "
                                 f"{tuple(self.gates.shape)}")
        want = (self.d_ff, self.stored_mats, self.row_width)
        if tuple(self.rows.shape) != want:
            raise ValueError(f"rows: expected shape {want}, got {tuple(self.rows.shape)}")
        if self.rows.dtype != DTYPES[self.dtype]:
            raise ValueError(
                f"rows: expected {DTYPES[self.dtype]} for dtype {self.dtype!r}, "
                f"got {self.rows.dtype}"
            )
        if not self.rows.is_contiguous():
            raise ValueError("rows: expected a contiguous tensor")
        if self.dtype == "q4i8":
            if not 0 < self.block <= self.d_model or self.scales is not None:
                raise ValueError(f"block/scales: expected 1..{self.d_model}/None for q4i8 (the "
                                 f"scales in the bundles), got {self.block}/"
                                 f"{None if self.scales is None else 'a tensor'}")
        elif self.dtype == "int8":
            if not 0 < self.block <= self.d_model:
                raise ValueError(f"block: expected 1..{self.d_model} for int8, got {self.block}")
            want_s = (self.d_ff, self.stored_mats, n_blocks(self.d_model, self.block))
            if self.scales is None or tuple(self.scales.shape) != want_s:
                found = None if self.scales is None else tuple(self.scales.shape)
                raise ValueError(f"scales: expected shape {want_s}, got {found}")
            if self.scales.dtype != torch.float32 or not self.scales.is_contiguous():
                raise ValueError(f"scales: expected contiguous float32, got {self.scales.dtype}")
        elif self.scales is not None or self.block != 0:
            raise ValueError(f"scales/block: expected None/0 for dtype {self.dtype!r}")
        if self.up_bias is not None:
            if self.gated:
                raise ValueError(f"up_bias: expected None for gated kind {self.kind!r}")
            if tuple(self.up_bias.shape) != (self.d_ff,) or self.up_bias.dtype != torch.float32:
                raise ValueError(
                    f"up_bias: expected float32 [{self.d_ff}], got {self.up_bias.dtype} "
                    f"{list(self.up_bias.shape)}"
                )
            if not self.up_bias.is_contiguous():
                raise ValueError("up_bias: expected a contiguous tensor")

    @property
    def gated(self) -> bool:
        return FFN_KINDS[self.kind].gated

    @property
    def n_mats(self) -> int:
        """Matrices per neuron: gate (gated kinds), up, down."""
        return 3 if self.gated else 2

    @property
    def stored_mats(self) -> int:
        """Rows per neuron in ``rows``: ``n_mats``, less the gate when it is apart; q4i8: 1 (a
        neuron's one bundle)."""
        return 1 if self.dtype == "q4i8" else self.n_mats - (self.gates is not None)

    @property
    def row_width(self) -> int:
        """Elements of ``rows`` per row: d_model, or bytes of a q4 row (Q4_0's) for q4, of a
        neuron's bundle for q4i8."""
        if self.dtype == "q4i8":
            return q4i8_layout(self.d_model, self.block).width
        return self.d_model // Q4_GROUP * Q4_BYTES if self.dtype == "q4" else self.d_model

    @property
    def bytes_per_neuron(self) -> int:
        """Bytes one active neuron reads: its bundled rows, scales, bias and gate row apart."""
        n = self.stored_mats * self.row_width * self.rows.element_size()
        if self.scales is not None:
            n += self.scales[0].numel() * 4
        if self.up_bias is not None:
            n += 4
        if self.gates is not None:
            n += self.gates.shape[1]
        return n

    @property
    def nbytes(self) -> int:
        n = self.rows.numel() * self.rows.element_size()
        for t in (self.scales, self.up_bias, self.gates):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    @classmethod
    def from_dense(
        cls,
        kind: str,
        gate: torch.Tensor | None,
        up: torch.Tensor,
        down: torch.Tensor,
        up_bias: torch.Tensor | None = None,
        dtype: str = "fp32",
        block: int = 0,
    ) -> PackedFFN:
        """Bundle nn.Linear-layout weights: gate/up ``[d_ff, d_model]``, down ``[d_model, d_ff]``.

        int8 quantizes each row symmetrically (absmax) per block of ``block`` weights
        (``block=0`` → one scale per row); q4 quantizes each row (and down column) to Q4_0's
        blocks of 32 as q4 rows (``quantize_q4_rows``; d_model a multiple of 32).
        """
        if kind not in FFN_KINDS:
            raise ValueError(f"kind: expected one of {sorted(FFN_KINDS)}, got {kind!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        gated = FFN_KINDS[kind].gated
        if up.dim() != 2:
            raise ValueError(f"up: expected [d_ff, d_model], got shape {list(up.shape)}")
        d_ff, d_model = up.shape
        if gated and (gate is None or tuple(gate.shape) != (d_ff, d_model)):
            found = None if gate is None else list(gate.shape)
            raise ValueError(f"gate: expected [{d_ff}, {d_model}] for kind {kind!r}, got {found}")
        if not gated and gate is not None:
            raise ValueError(f"gate: expected None for ungated kind {kind!r}, got a tensor")
        if tuple(down.shape) != (d_model, d_ff):
            raise ValueError(f"down: expected [{d_model}, {d_ff}], got {list(down.shape)}")
        if dtype != "int8" and block:
            raise ValueError(f"block: expected 0 for dtype {dtype!r}, got {block}")
        mats = ([gate] if gated else []) + [up, down.t()]
        if dtype == "q4" and d_model % Q4_GROUP:
            raise ValueError(f"q4: expected d_model a multiple of {Q4_GROUP}, got {d_model}")
        width = d_model // Q4_GROUP * Q4_BYTES if dtype == "q4" else d_model
        rows = empty_hugepages((d_ff, len(mats), width), DTYPES[dtype])
        scales = None
        if dtype == "q4":
            for m, w in enumerate(mats):
                rows[:, m] = quantize_q4_rows(w)
        elif dtype == "int8":
            block = block or d_model
            if not 0 < block <= d_model:
                raise ValueError(f"block: expected 0..{d_model}, got {block}")
            scales = torch.empty(d_ff, len(mats), n_blocks(d_model, block))
            for m, w in enumerate(mats):  # one matrix at a time: no full fp32 temporary
                rows[:, m], scales[:, m] = quantize_int8(w.detach(), block)
        else:
            for m, w in enumerate(mats):
                rows[:, m] = w.detach()
        bias = None
        if up_bias is not None:
            bias = up_bias.detach().to(torch.float32).reshape(-1).contiguous()
        return cls(kind, dtype, d_model, d_ff, rows, scales, block, bias)

    def rows_fp32(self, neurons: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized bundled rows ``[k, n_mats, d_model]`` fp32 (all neurons if None; gate
        rows apart in their place)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if neurons is None else t.index_select(0, neurons)

        rows = pick(self.rows)
        if self.dtype == "q4":
            return dequantize_q4_rows(rows)
        if self.dtype == "q4i8":
            lay, d = q4i8_layout(self.d_model, self.block), self.d_model
            b = rows[:, 0]
            scales = b[:, : lay.up].contiguous().view(torch.float32)
            up = dequantize_q4_rows(b[:, lay.up : lay.down])
            down = b[:, lay.down : lay.down + d].contiguous().view(torch.int8).float()
            down = down * expand_scales(scales, self.block, d)
            gate = dequantize_q4_rows(pick(self.gates))
            return torch.stack([gate, up, down], dim=1)
        w = rows.to(torch.float32)
        if self.scales is not None:
            w = w * expand_scales(pick(self.scales), self.block, self.d_model)
        if self.gates is not None:
            w = torch.cat([dequantize_q4_rows(pick(self.gates)).unsqueeze(1), w], dim=1)
        return w

    def with_q4_gates(self, gates: torch.Tensor) -> PackedFFN:
        """These int8 bundles with their gate rows apart as the q4 rows ``gates`` (uint8
        ``[d_ff, d_model / 32 · 18]``, e.g. ``quantize_q4_rows(gate)``), the int8 gate rows
        dropped."""
        if self.gates is not None or self.dtype != "int8" or not self.gated:
            raise ValueError(f"with_q4_gates: expected int8 bundles with their gate rows, got "
                             f"{self.dtype} rows of kind {self.kind!r}"
                             f"{' already apart' if self.gates is not None else ''}")
        rows = empty_hugepages((self.d_ff, 2, self.row_width), self.rows.dtype)
        rows.copy_(self.rows[:, 1:])
        return replace(self, rows=rows, scales=self.scales[:, 1:].contiguous(), gates=gates)

    def with_q4_ups(self, ups: torch.Tensor) -> PackedFFN:
        """These int8 bundles with their gates apart (``with_q4_gates``) as dtype "q4i8": the up
        rows the q4 rows ``ups`` (uint8 ``[d_ff, d_model / 32 · 18]``, e.g. the file's Q4_0 up
        rows as ``q4_rows``), the int8 down rows and their scales kept, one bundle a neuron."""
        if self.dtype != "int8" or self.gates is None:
            raise ValueError(f"with_q4_ups: expected int8 bundles with their gates apart, got "
                             f"{self.dtype} rows{'' if self.gates is not None else ' (no gates)'}")
        rows = q4i8_rows(ups, self.rows[:, 1], self.scales[:, 1], self.block)
        return replace(self, dtype="q4i8", rows=rows, scales=None)

    def dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """fp32 ``(gate | None, up, down)`` in nn.Linear layout."""
        w = self.rows_fp32()
        gate = w[:, 0].contiguous() if self.gated else None
        up = w[:, self.n_mats - 2].contiguous()
        down = w[:, self.n_mats - 1].t().contiguous()
        return gate, up, down

    def select(self, neurons: torch.Tensor) -> PackedFFN:
        """The sub-FFN of ``neurons`` (in that order), e.g. a hot or cold tier."""
        neurons = torch.as_tensor(neurons, dtype=torch.long).reshape(-1)
        if neurons.numel() and not (0 <= int(neurons.min()) and int(neurons.max()) < self.d_ff):
            raise ValueError(f"neurons: expected indices in [0, {self.d_ff}), got out-of-range")
        rows = _select_rows(self.rows, neurons)
        pick = lambda t: None if t is None else t.index_select(0, neurons).contiguous()  # noqa: E731
        return replace(
            self,
            d_ff=int(neurons.numel()),
            rows=rows,
            scales=pick(self.scales),
            up_bias=pick(self.up_bias),
            gates=None if self.gates is None else _select_rows(self.gates, neurons),
        )

