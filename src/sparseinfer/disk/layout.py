"""The bundled neuron layout on disk: one tensor per layer, ``blk.N.ffn_bundle``, whose row i is
neuron i's gate row, up row and down column back to back (``PackedFFN.rows[i]`` as bytes), padded
to a stride that is a multiple of ``STRIDE_ALIGN`` bytes. One active neuron is then one
contiguous read, and a run of neighbouring neurons one read.

``bundle_file`` rewrites a sparse GGUF (``sparseinfer convert``'s output, with separate
``ffn_gate`` / ``ffn_up`` / ``ffn_down_t`` tensors) into this layout; everything else (attention,
norms, embeddings, predictors, statistics, metadata) is copied byte for byte. The row storage is
the one the runtime computes with (``q4``: q4 rows, GGUF Q4_0's numbers with each row's scales
first, ``sparse.packed.q4_rows``; the gate/up numbers of a Q4_0 file kept as they are; ``fp32``),
so the bytes read from disk go to the kernels unchanged. Tensor data starts on a ``DATA_ALIGN``
boundary, so with an aligned stride every neuron read is aligned for O_DIRECT.

The rows need not be in neuron order: ``bundle_file(..., orders=...)`` writes each layer's
neurons in a given order (``order.py``: co-activated neurons side by side, so that one token's
cold neurons come in fewer, longer reads) and stores where each neuron went, ``blk.N.ffn_bundle_pos``
(int32, ``[d_ff]``: the file row of neuron i). Without that tensor row i is neuron i.

**Gates apart** (``bundle_file``'s default for q4 rows of an FFN whose gate is a ReLU: ReGLU,
dReLU). A neuron whose ReLU gate is <= 0 contributes nothing whatever its up and down rows hold,
so the disk tier reads the predicted neurons' gate rows first and the up and down rows only of
those whose gate fired (``tier.py``). The gate rows then go in a tensor of their own,
``blk.N.ffn_bundle_gate`` (row i: neuron i's gate row, padded to ``sparseinfer.bundle.gate_stride``
bytes), and ``blk.N.ffn_bundle`` holds the up row and down column: the gates of neighbouring
neurons are one read, and so are their up/down rows.

Keys written: ``sparseinfer.bundle.dtype`` (row storage), ``sparseinfer.bundle.stride``,
``sparseinfer.bundle.order`` (``neuron`` or how the order was made), and with the gates apart
``sparseinfer.bundle.gate_stride``.
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
GATES = "blk.{}.ffn_bundle_gate"
POSITIONS = "blk.{}.ffn_bundle_pos"
BUNDLE_DTYPES = ("q4", "fp32")  # row storages without per-row scales
# q4 rows' layout (sparse.packed.q4_rows: each row's scales, then its quants), written with q4
# bundles; files from before it held Q4_0 blocks, which the kernels no longer read
Q4_LAYOUT_KEY, Q4_LAYOUT = "sparseinfer.bundle.q4_layout", "scales-first"
STRIDE_ALIGN = 512  # bytes: the logical block size O_DIRECT needs on common disks
DATA_ALIGN = 4096
COPY_CHUNK = 1024  # neurons per read when copying a reordered file's neurons into RAM
_FFN_ROWS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down_t|down)\.weight$")


@dataclass(frozen=True)
class Part:
    """One tensor of a layer's neurons in the file: row i (file row) of layer l is ``nbytes`` at
    ``offsets[l] + i * stride``, rows ``first_mat`` onwards of a neuron's ``[n_mats,
    row_width]`` rows in RAM."""

    name: str  # "bundle" (every row, or up and down with the gates apart) | "gate"
    offsets: tuple[int, ...]
    stride: int
    nbytes: int
    first_mat: int


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
    # the gate rows apart (module docstring): their stride and per-layer offsets; 0: bundled
    gate_stride: int = 0
    gate_offsets: tuple[int, ...] = ()

    @property
    def row_width(self) -> int:
        return self.d_model // Q4_GROUP * Q4_BYTES if self.dtype == "q4" else self.d_model

    @property
    def row_bytes(self) -> int:
        return self.row_width * DTYPES[self.dtype].itemsize

    @property
    def bundle_bytes(self) -> int:
        """Bytes of one neuron's rows in RAM (gate, up and down: without the stride's padding)."""
        return self.n_mats * self.row_bytes

    @property
    def gates_apart(self) -> bool:
        return self.gate_stride > 0

    @property
    def parts(self) -> dict[str, Part]:
        """The file's tensors of neuron rows: ``bundle`` alone, or ``gate`` and ``bundle``."""
        if not self.gates_apart:
            return {"bundle": Part("bundle", self.offsets, self.stride, self.bundle_bytes, 0)}
        return {"gate": Part("gate", self.gate_offsets, self.gate_stride, self.row_bytes, 0),
                "bundle": Part("bundle", self.offsets, self.stride,
                               (self.n_mats - 1) * self.row_bytes, 1)}

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
    if dtype == "q4" and str(src.metadata.get(Q4_LAYOUT_KEY, "")) != Q4_LAYOUT:
        raise SparseInferError(f"{src.path}: {Q4_LAYOUT_KEY}: expected {Q4_LAYOUT!r} (q4 rows "
                               f"with their scales first), found "
                               f"{src.metadata.get(Q4_LAYOUT_KEY)!r} (Q4_0 blocks, from an "
                               f"older sparseinfer): rewrite it with `python -m "
                               f"sparseinfer.disk upgrade {src.path} NEW.gguf`")
    stride = int(src.metadata.get("sparseinfer.bundle.stride", 0))
    gate_stride = int(src.metadata.get("sparseinfer.bundle.gate_stride", 0))
    n_mats = 3 if cfg.ffn.gated else 2
    if gate_stride and not cfg.ffn.gated:
        raise SparseInferError(f"{src.path}: sparseinfer.bundle.gate_stride: expected none for "
                               f"an FFN without a gate ({cfg.ffn_kind}), found {gate_stride}")

    def offsets_of(name: str, width: int) -> tuple[int, ...]:
        out = []
        for i in range(cfg.n_layers):
            t = src.extras.get(name.format(i))
            if t is None:
                raise SparseInferError(f"{src.path}: bundled file: expected tensor "
                                       f"{name.format(i)!r}, found none")
            if tuple(t.shape) != (cfg.d_ff, width):
                raise SparseInferError(f"{src.path}: {t.name}: expected shape "
                                       f"{(cfg.d_ff, width)}, found {tuple(t.shape)}")
            out.append(int(t.gguf.data_offset))
        return tuple(out)

    positions = None
    if POSITIONS.format(0) in src.extras:
        positions = tuple(_positions(src, i, cfg.d_ff) for i in range(cfg.n_layers))
    lay = BundleLayout(Path(src.path), dtype, cfg.ffn_kind, cfg.d_model, cfg.d_ff, n_mats,
                       stride, offsets_of(BUNDLE, stride), positions, gate_stride,
                       offsets_of(GATES, gate_stride) if gate_stride else ())
    for part in lay.parts.values():
        if part.nbytes > part.stride:
            raise SparseInferError(f"{src.path}: {part.name} stride {part.stride} is smaller "
                                   f"than one neuron's {part.nbytes} bytes")
    return lay


def _positions(src, layer: int, d_ff: int) -> np.ndarray:
    t = src.extras.get(POSITIONS.format(layer))
    pos = None if t is None else np.asarray(src.extra_array(POSITIONS.format(layer)))
    if pos is None or pos.shape != (d_ff,) or not np.array_equal(np.sort(pos), np.arange(d_ff)):
        raise SparseInferError(f"{src.path}: {POSITIONS.format(layer)}: expected a permutation "
                               f"of range({d_ff}), found "
                               f"{'none' if pos is None else f'shape {pos.shape}'}")
    return pos.astype(np.int64)


def part_view(src, layer: int, start: int, stop: int, lay: BundleLayout, part: str = "bundle",
              ) -> np.ndarray:
    """File rows ``[start, stop)`` of one of a layer's neuron tensors (``BundleLayout.parts``)
    as a read-only view of the mapped file, ``[n, mats, row_width]`` in the row storage's numpy
    type."""
    p = lay.parts[part]
    name = (GATES if part == "gate" else BUNDLE).format(layer)
    raw = np.asarray(src.extras[name].raw()).view(np.uint8)
    raw = raw.reshape(lay.d_ff, p.stride)[start:stop, :p.nbytes]
    np_dtype = np.uint8 if lay.dtype == "q4" else np.float32
    return raw.view(np_dtype).reshape(stop - start, p.nbytes // lay.row_bytes, lay.row_width)


def rows_view(src, layer: int, start: int, stop: int, lay: BundleLayout | None = None,
              ) -> np.ndarray:
    """File rows ``[start, stop)`` of one layer's neurons, ``[n, n_mats, row_width]`` in the row
    storage's numpy type (row i is neuron i unless the file has a position map: ``neuron_rows``):
    a read-only view of the mapped file, or with the gates apart a copy of the two tensors' rows
    side by side; ``lay``: ``layout_of(src)`` if already made."""
    lay = layout_of(src) if lay is None else lay
    if not lay.gates_apart:
        return part_view(src, layer, start, stop, lay)
    return np.concatenate([part_view(src, layer, start, stop, lay, p) for p in lay.parts],
                          axis=1)


def copy_neurons(src, layer: int, start: int, stop: int, out: np.ndarray,
                 reader=None, lay: BundleLayout | None = None,
                 parts: tuple[str, ...] | None = None) -> None:
    """Copy neurons ``[start, stop)`` of ``layer`` (wherever the file holds them) into ``out``
    (``[n, n_mats, row_width]``, contiguous) without keeping the file's pages: a neuron-order
    file through the map, whose pages are then dropped from the process and the page cache;
    rows in another order with O_DIRECT reads (through a map, scattered rows would fault in
    most of the layer) by ``reader`` (a ``NeuronReader`` of this file; None: one made for the
    call; ``lay``: ``layout_of(src)`` if already made, used when ``reader`` is None).
    ``parts``: only these of the file's tensors (``BundleLayout.parts``, in order; e.g.
    ``("gate",)``), ``out`` then holding their rows alone."""
    from ..fileio import drop_pages
    from .reader import NeuronReader, drop_file_cache

    if reader is not None:
        lay = reader.layout
    elif lay is None:
        lay = layout_of(src)
    if stop <= start:
        return
    parts = tuple(lay.parts) if parts is None else parts
    base = lay.parts[parts[0]].first_mat  # out's first row
    if lay.positions is None:
        for name in parts:
            p = lay.parts[name]
            view = part_view(src, layer, start, stop, lay, name)
            out[:, p.first_mat - base:p.first_mat - base + view.shape[1]] = view
            drop_pages(view)
            drop_file_cache(lay.path, p.offsets[layer] + start * p.stride, (stop - start) * p.stride)
        return
    own = reader is None
    reader = NeuronReader(lay) if own else reader
    try:
        dest = out.reshape(stop - start, -1).view(np.uint8)
        for a in range(start, stop, COPY_CHUNK):  # a bounded read buffer, not the whole layer
            b = min(stop, a + COPY_CHUNK)
            for name in parts:
                p = lay.parts[name]
                col = (p.first_mat - base) * lay.row_bytes
                dest[a - start:b - start, col:col + p.nbytes] = reader.read(
                    layer, np.arange(a, b), name)
    finally:
        if own:
            reader.close()


def read_packed(src, layer: int, start: int, stop: int, up_bias=None,
                lay: BundleLayout | None = None, reader=None) -> PackedFFN:
    """Neurons ``[start, stop)`` as a ``PackedFFN`` in memory (``copy_neurons``, with ``reader``
    if given); ``lay``: ``layout_of(src)`` if already made (a model's layers share one: it reads
    every layer's offsets and position map)."""
    from ..sparse.packed import empty_hugepages

    lay = layout_of(src) if lay is None else lay
    rows = empty_hugepages((stop - start, lay.n_mats, lay.row_width), DTYPES[lay.dtype])
    copy_neurons(src, layer, start, stop, rows.numpy(), reader, lay)
    bias = None if up_bias is None else up_bias[start:stop].contiguous()
    return PackedFFN(lay.kind, lay.dtype, lay.d_model, stop - start, rows, None, 0, bias)


def bundle_file(src_path: str | Path, out_path: str | Path, dtype: str = "q4",
                orders: list[np.ndarray] | None = None, order_name: str = "coactivation",
                gates_apart: bool | None = None, progress=None) -> Path:
    """Rewrite the sparse GGUF ``src_path`` with bundled neuron rows (see the module docstring);
    ``orders``: per layer, the neurons in the order their rows are written (``order.py``), named
    ``order_name`` in the metadata; None: neuron order. ``gates_apart``: the gate rows in a
    tensor of their own (FFNs with a ReLU gate only); None: for q4 rows of such an FFN, which
    the disk tier then computes gates first (fp32 rows it would read in two parts).
    ``progress``: as ``_write_gguf``'s."""
    from gguf import GGMLQuantizationType

    from ..models.build import _packed_ffn
    from ..models.loading import open_source
    from ..offline.export import check_output_path

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
    if gates_apart is None:
        gates_apart = dtype == "q4" and relu_gated(cfg.ffn_kind)
    if gates_apart and not relu_gated(cfg.ffn_kind):
        raise SparseInferError(f"bundle with the gates apart: expected an FFN with a ReLU gate "
                               f"(reglu, drelu), got {cfg.ffn_kind}")
    n_mats = 3 if cfg.ffn.gated else 2
    width = cfg.d_model // Q4_GROUP * Q4_BYTES if dtype == "q4" else cfg.d_model
    row = width * DTYPES[dtype].itemsize

    def aligned(n: int) -> int:
        return -(-n // STRIDE_ALIGN) * STRIDE_ALIGN

    nbytes = (n_mats - gates_apart) * row
    stride, gate_stride = aligned(nbytes), aligned(row) if gates_apart else 0

    def names(i: int) -> tuple[str, ...]:
        p = f"layers.{i}.ffn."
        down = p + "down_t.weight" if p + "down_t.weight" in src.tensors else p + "down.weight"
        return tuple(([p + "gate.weight"] if cfg.ffn.gated else []) + [p + "up.weight", down])

    reader = src.reader

    def add_kv(writer) -> None:
        writer.add_string("sparseinfer.bundle.dtype", dtype)
        if dtype == "q4":
            writer.add_string(Q4_LAYOUT_KEY, Q4_LAYOUT)
        writer.add_uint32("sparseinfer.bundle.stride", stride)
        if gates_apart:
            writer.add_uint32("sparseinfer.bundle.gate_stride", gate_stride)
        writer.add_string("sparseinfer.bundle.order", "neuron" if orders is None else order_name)

    plan = []  # (name, torch shape, type, nbytes, make)
    for t in reader.tensors:
        m = _FFN_ROWS.match(t.name)
        if m:
            i = int(m.group(1))
            if m.group(2) in ("down_t", "down"):  # the bundle takes the layer's place
                order = None if orders is None else np.asarray(orders[i], dtype=np.int64)
                packed = _Packed(lambda i=i: _packed_ffn(src, names(i), cfg.ffn_kind, dtype,
                                                         None))
                if gates_apart:  # (made once for both tensors)
                    plan.append((GATES.format(i), (cfg.d_ff, gate_stride),
                                 GGMLQuantizationType.I8, cfg.d_ff * gate_stride,
                                 lambda p=packed, order=order: _bundle_bytes(
                                     p.get(), gate_stride, order, 0, row)))
                plan.append((BUNDLE.format(i), (cfg.d_ff, stride), GGMLQuantizationType.I8,
                             cfg.d_ff * stride, lambda p=packed, order=order: _bundle_bytes(
                                 p.pop(), stride, order, gates_apart * row, nbytes)))
                if order is not None:
                    pos = positions_of(order)
                    plan.append((POSITIONS.format(i), (cfg.d_ff,), GGMLQuantizationType.I32,
                                 pos.nbytes, lambda pos=pos: pos))
            continue
        plan.append(_as_is(t))
    _write_gguf(out_path, reader, str(src.metadata.get("general.architecture", cfg.arch)),
                add_kv, plan, progress=progress)
    log.info("wrote %s: %s bundles of %d bytes (stride %d)%s", out_path, dtype, nbytes, stride,
             f", gate rows apart (stride {gate_stride})" if gates_apart else "")
    return out_path


def upgrade_file(src_path: str | Path, out_path: str | Path, progress=None) -> Path:
    """Rewrite a q4 bundled file from before q4 rows put their scales first (its rows Q4_0
    blocks, no ``Q4_LAYOUT_KEY``) with its rows as q4 rows (``sparse.packed.q4_rows``): the same
    numbers, bytes, order and everything else, so a bundled file whose sparse GGUF is gone need
    not be converted again. ``progress``: as ``_write_gguf``'s. Returns ``out_path``."""
    from ..models.loading import open_source
    from ..offline.export import check_output_path
    from ..sparse.packed import q4_rows

    out_path = check_output_path(out_path)
    src = open_source(src_path)
    if not is_bundled(src) or src.reader is None:
        raise SparseInferError(f"{src_path}: expected a bundled GGUF (python -m sparseinfer.disk "
                               f"bundle), found none of its {BUNDLE.format(0)!r}")
    md = src.metadata
    if md.get("sparseinfer.bundle.dtype") != "q4" or md.get(Q4_LAYOUT_KEY) == Q4_LAYOUT:
        raise SparseInferError(f"{src_path}: expected q4 bundles of Q4_0 blocks (no "
                               f"{Q4_LAYOUT_KEY}), found {md.get('sparseinfer.bundle.dtype')!r}"
                               f" bundles, {Q4_LAYOUT_KEY} {md.get(Q4_LAYOUT_KEY)!r}: nothing "
                               f"to upgrade")
    cfg = src.config
    row = cfg.d_model // Q4_GROUP * Q4_BYTES
    rows_in = {BUNDLE: (3 if cfg.ffn.gated else 2) - bool(md.get("sparseinfer.bundle.gate_stride")),
               GATES: 1}
    names = {name.format(i): n for name, n in rows_in.items() for i in range(cfg.n_layers)}

    def upgraded(t, n: int) -> np.ndarray:
        a = np.array(t.data).view(np.uint8).reshape(cfg.d_ff, -1)  # a copy, rows rewritten
        if a.shape[1] < n * row:
            raise SparseInferError(f"{src_path}: {t.name}: expected rows of at least "
                                   f"{n * row} bytes, found {a.shape[1]}")
        for lo in range(0, cfg.d_ff, COPY_CHUNK):  # (bounded temporaries)
            for m in range(n):
                part = a[lo:lo + COPY_CHUNK, m * row:(m + 1) * row]
                part[...] = q4_rows(torch.from_numpy(part.copy())).numpy()
        return a.view(np.int8)

    plan = [_entry(t, lambda t=t, n=names[t.name]: upgraded(t, n)) if t.name in names
            else _as_is(t) for t in src.reader.tensors]
    _write_gguf(out_path, src.reader, str(md.get("general.architecture", cfg.arch)),
                lambda writer: writer.add_string(Q4_LAYOUT_KEY, Q4_LAYOUT), plan,
                drop=(Q4_LAYOUT_KEY,), progress=progress)
    log.info("wrote %s: %s's q4 bundles with each row's scales first", out_path, src_path)
    return out_path


def _entry(t, make) -> tuple:
    """A GGUF tensor of the source in ``_write_gguf``'s plan, its bytes from ``make()``."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return (t.name, shape, t.tensor_type, int(t.n_bytes), make)


def _as_is(t) -> tuple:
    """A GGUF tensor of the source, for ``_write_gguf``'s plan, copied as it is."""
    return _entry(t, lambda: np.asarray(t.data))


def _write_gguf(out_path: Path, reader, arch: str, add_kv, plan: list[tuple],
                drop: tuple[str, ...] = (), progress=None) -> None:
    """Write ``out_path`` (through a temporary file beside it, renamed at the end): the fields
    of ``reader`` but GGUF's own and the keys in ``drop``, those ``add_kv(writer)`` adds, and
    the tensors of ``plan`` ((name, torch shape, type, nbytes, make), ``make()`` giving the
    bytes, called in order) with their data on ``DATA_ALIGN`` boundaries. ``progress`` (None,
    or given the bytes to write, a callable taking each tensor's bytes as they are written:
    ``offline.pipeline.Bars``' stages are such)."""
    from gguf import GGUFWriter

    from ..offline.export import _copy_fields

    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp",
                                    dir=out_path.parent if str(out_path.parent) else ".")
    os.close(fd)
    tmp = Path(tmp_name)
    writer = GGUFWriter(tmp, arch)
    writer.add_custom_alignment(DATA_ALIGN)
    try:
        _copy_fields(writer, reader, lambda k: not k.startswith(
            ("GGUF.", "general.architecture", "general.alignment")) and k not in drop)
        add_kv(writer)
        for name, shape, qtype, n, _ in plan:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), n, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        step = progress(sum(p[3] for p in plan)) if progress else None
        for name, _, _, n, make in plan:
            data = make()
            if data.nbytes != n:
                raise SparseInferError(f"tensor {name}: expected {n} bytes, produced "
                                       f"{data.nbytes}")
            writer.write_tensor_data(data)
            if step:
                step(n)
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


def relu_gated(kind: str) -> bool:
    """Whether an FFN kind's gate is a ReLU (h = 0 wherever the gate is <= 0)."""
    from ..config import FFN_KINDS

    k = FFN_KINDS[kind]
    return k.gated and k.gate_act == "relu"


class _Packed:
    """A layer's packed rows, made on first use and kept until ``pop`` (the gate tensor and the
    bundle tensor of one layer are written one after the other from the same rows)."""

    def __init__(self, make):
        self._make, self._value = make, None

    def get(self) -> PackedFFN:
        if self._value is None:
            self._value = self._make()
        return self._value

    def pop(self) -> PackedFFN:
        value, self._value = self.get(), None
        return value


def _bundle_bytes(packed: PackedFFN, stride: int, order: np.ndarray | None, lo: int = 0,
                  n: int | None = None) -> np.ndarray:
    """Bytes ``[lo, lo + n)`` of each neuron's rows (all of them: n None), one neuron a row of
    ``stride`` bytes, in ``order``."""
    raw = packed.rows.contiguous().view(torch.uint8).reshape(packed.d_ff, -1).numpy()
    raw = raw[:, lo:None if n is None else lo + n]
    out = np.zeros((packed.d_ff, stride), dtype=np.int8)
    out.view(np.uint8)[:, :raw.shape[1]] = raw if order is None else raw[order]
    return out
