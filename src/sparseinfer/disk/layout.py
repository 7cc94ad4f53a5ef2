"""The bundled neuron layout on disk: one tensor per layer, ``blk.N.ffn_bundle``, whose row i is
neuron i's gate row, up row and down column back to back (``PackedFFN.rows[i]`` as bytes), padded
to a stride that is a multiple of ``STRIDE_ALIGN`` bytes. One active neuron is then one
contiguous read, and a run of neighbouring neurons one read.

``bundle_file`` rewrites a sparse GGUF (``sparseinfer convert``'s output, with separate
``ffn_gate`` / ``ffn_up`` / ``ffn_down_t`` tensors) into this layout; everything else (attention,
norms, embeddings, predictors, statistics, metadata) is copied byte for byte. The row storage is
the one the runtime computes with (``q4``: GGUF Q4_0 blocks, the gate/up blocks of a Q4_0 file
copied as they are; ``fp32``), so the bytes read from disk go to the kernels unchanged. Tensor
data starts on a ``DATA_ALIGN`` boundary, so with an aligned stride every neuron read is aligned
for O_DIRECT.

The rows need not be in neuron order: ``bundle_file(..., orders=...)`` writes each layer's
neurons in a given order (``order.py``: co-activated neurons side by side, so that one token's
cold neurons come in fewer, longer reads) and stores where each neuron went, ``blk.N.ffn_bundle_pos``
(int32, ``[d_ff]``: the file row of neuron i). Without that tensor row i is neuron i.

Keys written: ``sparseinfer.bundle.dtype`` (row storage), ``sparseinfer.bundle.stride``,
``sparseinfer.bundle.order`` (``neuron`` or how the order was made).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SparseInferError
from ..sparse.packed import DTYPES, Q4_BYTES, Q4_GROUP, PackedFFN
from .order import positions_of

log = logging.getLogger(__name__)

BUNDLE = "blk.{}.ffn_bundle"
POSITIONS = "blk.{}.ffn_bundle_pos"
BUNDLE_DTYPES = ("q4", "fp32")  # row storages without per-row scales
STRIDE_ALIGN = 512  # bytes: the logical block size O_DIRECT needs on common disks
DATA_ALIGN = 4096
COPY_CHUNK = 1024  # neurons per read when copying a reordered file's neurons into RAM
_FFN_ROWS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down_t|down)\.weight$")


@dataclass(frozen=True)
class BundleLayout:
    """Where each layer's neurons are in the file (read from a bundled file's index)."""

    path: Path
    dtype: str  # "q4" | "fp32"
    kind: str  # FFN kind
    d_model: int
    d_ff: int
    n_mats: int
    stride: int  # bytes from one neuron to the next (>= bundle_bytes)
    offsets: tuple[int, ...]  # per layer: file offset of the bundle's row 0
    # per layer: the file row of each neuron (None: row i is neuron i)
    positions: tuple[np.ndarray, ...] | None = None

    @property
    def row_width(self) -> int:
        return self.d_model // Q4_GROUP * Q4_BYTES if self.dtype == "q4" else self.d_model

    @property
    def bundle_bytes(self) -> int:
        """Bytes of one neuron's rows (without the stride's padding)."""
        return self.n_mats * self.row_width * DTYPES[self.dtype].itemsize

    def row_of(self, layer: int, neurons: np.ndarray) -> np.ndarray:
        """File rows of ``neurons`` in ``layer``'s bundle."""
        return neurons if self.positions is None else self.positions[layer][neurons]

    def row_offset(self, layer: int, row: int) -> int:
        return self.offsets[layer] + row * self.stride

    def neuron_offset(self, layer: int, neuron: int) -> int:
        return self.row_offset(layer, int(self.row_of(layer, np.int64(neuron))))


def is_bundled(src) -> bool:
    return BUNDLE.format(0) in src.extras


def layout_of(src) -> BundleLayout:
    """The bundle layout of an opened bundled file (``models.loading.ModelSource``)."""
    cfg = src.config
    dtype = str(src.metadata.get("sparseinfer.bundle.dtype", ""))
    if dtype not in BUNDLE_DTYPES:
        raise SparseInferError(f"{src.path}: sparseinfer.bundle.dtype: expected one of "
                               f"{list(BUNDLE_DTYPES)}, found {dtype!r}")
    stride = int(src.metadata.get("sparseinfer.bundle.stride", 0))
    n_mats = 3 if cfg.ffn.gated else 2
    offsets = []
    for i in range(cfg.n_layers):
        t = src.extras.get(BUNDLE.format(i))
        if t is None:
            raise SparseInferError(f"{src.path}: bundled file: expected tensor "
                                   f"{BUNDLE.format(i)!r}, found none")
        if tuple(t.shape) != (cfg.d_ff, stride):
            raise SparseInferError(f"{src.path}: {t.name}: expected shape {(cfg.d_ff, stride)}, "
                                   f"found {tuple(t.shape)}")
        offsets.append(int(t.gguf.data_offset))
    positions = None
    if POSITIONS.format(0) in src.extras:
        positions = tuple(_positions(src, i, cfg.d_ff) for i in range(cfg.n_layers))
    lay = BundleLayout(Path(src.path), dtype, cfg.ffn_kind, cfg.d_model, cfg.d_ff, n_mats,
                       stride, tuple(offsets), positions)
    if lay.bundle_bytes > stride:
        raise SparseInferError(f"{src.path}: bundle stride {stride} is smaller than one neuron's "
                               f"{lay.bundle_bytes} bytes")
    return lay


def _positions(src, layer: int, d_ff: int) -> np.ndarray:
    t = src.extras.get(POSITIONS.format(layer))
    pos = None if t is None else np.asarray(src.extra_array(POSITIONS.format(layer)))
    if pos is None or pos.shape != (d_ff,) or not np.array_equal(np.sort(pos), np.arange(d_ff)):
        raise SparseInferError(f"{src.path}: {POSITIONS.format(layer)}: expected a permutation "
                               f"of range({d_ff}), found "
                               f"{'none' if pos is None else f'shape {pos.shape}'}")
    return pos.astype(np.int64)


def rows_view(src, layer: int, start: int, stop: int, lay: BundleLayout | None = None,
              ) -> np.ndarray:
    """File rows ``[start, stop)`` of one layer's bundle as a read-only view of the mapped file,
    ``[n, n_mats, row_width]`` in the row storage's numpy type (row i is neuron i unless the file
    has a position map: ``neuron_rows``); ``lay``: ``layout_of(src)`` if already made."""
    lay = layout_of(src) if lay is None else lay
    raw = np.asarray(src.extras[BUNDLE.format(layer)].raw()).view(np.uint8)
    raw = raw.reshape(lay.d_ff, lay.stride)[start:stop, :lay.bundle_bytes]
    np_dtype = np.uint8 if lay.dtype == "q4" else np.float32
    return raw.view(np_dtype).reshape(stop - start, lay.n_mats, lay.row_width)


def copy_neurons(src, layer: int, start: int, stop: int, out: np.ndarray,
                 reader=None, lay: BundleLayout | None = None) -> None:
    """Copy neurons ``[start, stop)`` of ``layer`` (wherever the file holds them) into ``out``
    (``[n, n_mats, row_width]``, contiguous) without keeping the file's pages: a neuron-order
    file through the map, whose pages are then dropped from the process and the page cache;
    rows in another order with O_DIRECT reads (through a map, scattered rows would fault in
    most of the layer) by ``reader`` (a ``NeuronReader`` of this file; None: one made for the
    call; ``lay``: ``layout_of(src)`` if already made, used when ``reader`` is None)."""
    from ..fileio import drop_pages
    from .reader import NeuronReader, drop_file_cache

    if reader is not None:
        lay = reader.layout
    elif lay is None:
        lay = layout_of(src)
    if stop <= start:
        return
    if lay.positions is None:
        view = rows_view(src, layer, start, stop, lay)
        out[:] = view
        drop_pages(view)
        drop_file_cache(lay.path, lay.row_offset(layer, start), (stop - start) * lay.stride)
        return
    own = reader is None
    reader = NeuronReader(lay) if own else reader
    try:
        dest = out.reshape(-1).view(np.uint8).reshape(stop - start, -1)
        for a in range(start, stop, COPY_CHUNK):  # a bounded read buffer, not the whole layer
            b = min(stop, a + COPY_CHUNK)
            dest[a - start:b - start] = reader.read(layer, np.arange(a, b))
    finally:
        if own:
            reader.close()


def read_packed(src, layer: int, start: int, stop: int, up_bias=None,
                lay: BundleLayout | None = None) -> PackedFFN:
    """Neurons ``[start, stop)`` as a ``PackedFFN`` in memory (``copy_neurons``); ``lay``:
    ``layout_of(src)`` if already made (a model's layers share one: it reads every layer's
    offsets and position map)."""
    from ..sparse.packed import empty_hugepages

    lay = layout_of(src) if lay is None else lay
    rows = empty_hugepages((stop - start, lay.n_mats, lay.row_width), DTYPES[lay.dtype])
    copy_neurons(src, layer, start, stop, rows.numpy(), lay=lay)
    bias = None if up_bias is None else up_bias[start:stop].contiguous()
    return PackedFFN(lay.kind, lay.dtype, lay.d_model, stop - start, rows, None, 0, bias)


def bundle_file(src_path: str | Path, out_path: str | Path, dtype: str = "q4",
                orders: list[np.ndarray] | None = None, order_name: str = "coactivation") -> Path:
    """Rewrite the sparse GGUF ``src_path`` with bundled neuron rows (see the module docstring);
    ``orders``: per layer, the neurons in the order their rows are written (``order.py``), named
    ``order_name`` in the metadata; None: neuron order."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from ..models.build import _packed_ffn
    from ..models.loading import open_source
    from ..offline.export import _copy_fields, check_output_path

    if dtype not in BUNDLE_DTYPES:
        raise SparseInferError(f"bundle dtype: expected one of {list(BUNDLE_DTYPES)}, got "
                               f"{dtype!r}")
    out_path = check_output_path(out_path)
    src = open_source(src_path)
    cfg = src.config
    if "blk.0.fc1.weight" not in src.extras:
        raise SparseInferError(f"{src_path}: expected a sparse GGUF (with predictors "
                               f"blk.N.fc1/fc2), found none")
    if is_bundled(src):
        raise SparseInferError(f"{src_path}: already bundled")
    if src.reader is None:
        raise SparseInferError(f"{src_path}: expected a GGUF file")
    if orders is not None:
        if len(orders) != cfg.n_layers:
            raise SparseInferError(f"bundle orders: expected one per layer ({cfg.n_layers}), "
                                   f"got {len(orders)}")
        for i, o in enumerate(orders):
            if not np.array_equal(np.sort(np.asarray(o)), np.arange(cfg.d_ff)):
                raise SparseInferError(f"bundle order of layer {i}: expected a permutation of "
                                       f"range({cfg.d_ff})")
    n_mats = 3 if cfg.ffn.gated else 2
    width = cfg.d_model // Q4_GROUP * Q4_BYTES if dtype == "q4" else cfg.d_model
    nbytes = n_mats * width * DTYPES[dtype].itemsize
    stride = -(-nbytes // STRIDE_ALIGN) * STRIDE_ALIGN

    def names(i: int) -> tuple[str, ...]:
        p = f"layers.{i}.ffn."
        down = p + "down_t.weight" if p + "down_t.weight" in src.tensors else p + "down.weight"
        return tuple(([p + "gate.weight"] if cfg.ffn.gated else []) + [p + "up.weight", down])

    reader = src.reader
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp",
                                    dir=out_path.parent if str(out_path.parent) else ".")
    os.close(fd)
    tmp = Path(tmp_name)
    arch = str(src.metadata.get("general.architecture", cfg.arch))
    writer = GGUFWriter(tmp, arch)
    writer.add_custom_alignment(DATA_ALIGN)
    try:
        _copy_fields(writer, reader, lambda k: not k.startswith(
            ("GGUF.", "general.architecture", "general.alignment")))
        writer.add_string("sparseinfer.bundle.dtype", dtype)
        writer.add_uint32("sparseinfer.bundle.stride", stride)
        writer.add_string("sparseinfer.bundle.order", "neuron" if orders is None else order_name)
        plan = []  # (name, torch shape, type, nbytes, make)
        for t in reader.tensors:
            m = _FFN_ROWS.match(t.name)
            if m:
                i = int(m.group(1))
                if m.group(2) in ("down_t", "down"):  # the bundle takes the layer's place
                    order = None if orders is None else np.asarray(orders[i], dtype=np.int64)
                    plan.append((BUNDLE.format(i), (cfg.d_ff, stride), GGMLQuantizationType.I8,
                                 cfg.d_ff * stride, lambda i=i, order=order: _bundle_bytes(
                                     _packed_ffn(src, names(i), cfg.ffn_kind, dtype, None),
                                     stride, order)))
                    if order is not None:
                        pos = positions_of(order)
                        plan.append((POSITIONS.format(i), (cfg.d_ff,), GGMLQuantizationType.I32,
                                     pos.nbytes, lambda pos=pos: pos))
                continue
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            plan.append((t.name, shape, t.tensor_type, int(t.n_bytes),
                         lambda t=t: np.asarray(t.data)))
        for name, shape, qtype, n, _ in plan:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), n, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, _, _, n, make in plan:
            data = make()
            if data.nbytes != n:
                raise SparseInferError(f"tensor {name}: expected {n} bytes, produced "
                                       f"{data.nbytes}")
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, out_path)
    except OSError as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise SparseInferError(f"{out_path}: cannot write: {e.strerror or e}") from None
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s: %s bundles of %d bytes (stride %d)", out_path, dtype, nbytes, stride)
    return out_path


def _bundle_bytes(packed: PackedFFN, stride: int, order: np.ndarray | None) -> np.ndarray:
    raw = packed.rows.contiguous().view(torch.uint8).reshape(packed.d_ff, -1).numpy()
    out = np.zeros((packed.d_ff, stride), dtype=np.int8)
    out.view(np.uint8)[:, :raw.shape[1]] = raw if order is None else raw[order]
    return out
