"""The disk tier at run time: ``DiskFFN``, a sparse FFN whose cold neurons live in the file.

Per token and layer::

    active = predictor(x)                       (as SparseFFN)
    hot  = active <  n_ram  -> rows in RAM      (the hottest neurons, placed by the RAM budget)
    cold = active >= n_ram  -> the layer's NeuronCache: hits in RAM, misses read from the file
    1. start the reads of the cold misses              (reader threads, O_DIRECT)
    2. prefetch: layer l+1's predictor on this layer's residual stream (through layer l+1's FFN
       norm: Deja Vu's look-ahead) names neurons layer l+1 will likely need; their reads start
       and run on while this layer (and the next attention) computes
    3. wait for the misses; one kernel call over the RAM rows and the cache's slots, which are
       one tensor (RAM neurons first, then the slots), in the neurons' order

**Three tiers** (``--vram-budget`` beside ``--ram-budget``): the hottest prefix ``[0, n_fast)``
lives on the fast device and is computed there in torch (as ``SparseFFN``'s fast tier), launched
before the CPU's part; RAM holds ``[n_fast, n_ram)``, the file the rest. Verified with the CPU
standing in for the device (tests), not on a GPU (none here).

**Gates first** (a ReLU gate, q4 rows, a file with the gates apart: ``layout.py``): a neuron whose
gate is <= 0 contributes nothing, so steps 1 and 2 read only the gate rows of the cold neurons
(beside the cache, in one read per layer, the look-ahead beginning the next layer's; the plan may
keep gate rows in RAM: ``plan.py``); their gates are computed (``kernels.gate_dots``: the kernel's
own arithmetic, so "fired" is exactly what the kernel decides) and only the neurons whose gate
fired take cache slots and have their up and down rows read. The kernel then gets the active set
with the other cold neurons masked out (never read), so the sums are those of the all-in-RAM
call. The predictors select several times more neurons than fire on a ReLU model
(benchmarks/RESULTS.md), so most cold neurons cost a third of their bytes, or none.

What is computed is exactly the predictor's active set, whatever was cached or prefetched, summed
in the same order: the output equals the all-in-RAM model's bit for bit (an active set larger
than the cache goes in chunks, whose float sums differ in order only). Several tokens at once
(prefill) run the union of their active sets through the same path in chunks of the cache's size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..sparse import kernels
from ..sparse.ffn import AllNeurons, Selector, SparseFFN
from ..sparse.packed import PackedFFN
from ..sparse.reference import neuron_coefs, sparse_ffn_ref
from .cache import CacheStats, NeuronCache
from .layout import relu_gated

log = logging.getLogger(__name__)


@dataclass
class PrefetchStats:
    predicted: int = 0  # cold, uncached neurons the look-ahead named (before the limit)
    issued: int = 0  # reads started
    tokens: int = 0


class GateRows:
    """Gate rows of ``neurons`` being read (gates first): ``wait()`` gives them ``[k, row]``
    in ``neurons``' order, from one or more reads (``ReadBatch``) that cover them."""

    def __init__(self, neurons: np.ndarray, batches: list):
        self.neurons, self._batches = neurons, batches

    def wait(self) -> np.ndarray:
        got = [(b.neurons, b.wait()) for b in self._batches]
        if len(got) == 1 and np.array_equal(got[0][0], self.neurons):
            return got[0][1]
        names = np.concatenate([n for n, _ in got])
        rows = np.concatenate([r for _, r in got])
        order = np.argsort(names, kind="stable")
        pos = np.searchsorted(names[order], self.neurons)
        return rows[order[pos]]


class DiskFFN(SparseFFN):
    """A sparse FFN with its hot prefix ``[0, n_ram)`` in RAM and the rest read from the file
    through a ``NeuronCache`` (see the module docstring)."""

    def __init__(self, kind: str, d_model: int, d_ff: int, selector: Selector, n_ram: int,
                 prefetch: bool = True, prefetch_limit: int | None = None, n_fast: int = 0,
                 fast_device: str | torch.device = "cpu"):
        super().__init__(kind, d_model, d_ff, selector, 0, fast_device, False)
        self.n_ram = int(n_ram)
        # three tiers: neurons [0, n_fast) on the fast device (``fast_rows``), [n_fast, n_ram) in
        # RAM (``rows`` from row 0), the rest in the file
        self.n_fast = int(n_fast)
        if not 0 <= self.n_fast <= self.n_ram:
            raise ValueError(f"expected 0 <= fast-tier neurons <= RAM neurons, got {n_fast} and "
                             f"{n_ram}")
        self.fast_rows: PackedFFN | None = None
        self.cache: NeuronCache | None = None
        self._next: tuple = (None, None)  # (next layer's DiskFFN, its FFN norm): not submodules
        self.prefetch_on = prefetch
        self.prefetch_limit = prefetch_limit
        self.prefetch_stats = PrefetchStats()
        self.gates_first = False  # (module docstring)
        self._ahead = None  # the look-ahead's read of this layer's gate rows (gates first)

    def extra_repr(self) -> str:
        c = self.cache
        return (f"{self.kind_name}, d_ff={self.d_ff}, selector={self.selector!r}, "
                + (f"{self.n_fast} neurons on {self.fast}, " if self.n_fast else "")
                + f"{self.n_ram - self.n_fast} neurons in RAM, {self.d_ff - self.n_ram} on disk, "
                f"cache {c.capacity if c else '?'} slots ({c.eviction if c else '?'}), "
                f"prefetch {'on' if self.prefetch_on else 'off'}"
                f"{', gates first' if self.gates_first else ''}")

    def fill_disk(self, rows: PackedFFN, cache: NeuronCache, down_bias: Tensor | None,
                  gate_rows: np.ndarray | None = None,
                  fast_rows: PackedFFN | None = None) -> None:
        """``rows``: the RAM neurons ``[n_fast, n_ram)`` followed by the cache's slots (whose
        storage ``cache.packed`` is a view of the tail): row ``n_ram - n_fast + s`` is the neuron
        in slot s. ``gate_rows``: gates first, the gate rows of the neurons after them kept in
        RAM (``[n, row bytes]``: neurons ``[n_ram, n_ram + n)``). ``fast_rows``: the neurons
        ``[0, n_fast)`` on the fast device."""
        n_ram = self.n_ram - self.n_fast
        if rows.d_ff != n_ram + cache.capacity:
            raise ValueError(f"expected {n_ram} + {cache.capacity} rows, got {rows.d_ff}")
        if (fast_rows.d_ff if fast_rows is not None else 0) != self.n_fast:
            raise ValueError(f"expected {self.n_fast} fast-tier rows, got "
                             f"{None if fast_rows is None else fast_rows.d_ff}")
        self.fast_rows = fast_rows
        self.rows = self.packed = rows
        self.hot = rows
        self.cold = cache.packed  # (SparseFFN reads .cold.dtype)
        self.cache = cache
        self.down_bias = down_bias
        # (kernels.gate_dots: q4 rows, in C)
        lay = cache.layout
        gates_first = lay.gates_apart and relu_gated(lay.kind) and rows.dtype == "q4"
        self.gates_first = bool(gates_first)
        gate_rows = np.empty((0, lay.row_bytes), np.uint8) if gate_rows is None else gate_rows
        if gate_rows.shape[0] and not gates_first:
            raise ValueError("gate rows in RAM: expected a disk tier that computes gates first")
        self.gate_ram = torch.from_numpy(gate_rows)
        self.n_gate = self.n_ram + gate_rows.shape[0]
        self._gate_known = np.arange(self.n_ram, self.n_gate)
        self._idx = torch.empty(self.d_ff, dtype=torch.int32)
        self._all = torch.arange(self.d_ff, dtype=torch.int32)
        self._out = torch.empty(self.d_model, dtype=torch.float32)
        self._out_cold = torch.empty(self.d_model, dtype=torch.float32)
        self._norms = None

    def link(self, nxt: DiskFFN | None, next_norm) -> None:
        """The next layer's FFN and FFN norm: the look-ahead prefetch predicts with them."""
        self._next = (nxt, next_norm)

    # ---- one token -----------------------------------------------------------------------------

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        if B * T > 1:
            return self._batch(x, residual)
        xv = x.reshape(D).float()
        idx = self.active(xv, residual).cpu()
        self.stats.tokens += 1
        self.stats.active += int(idx.numel())
        fast = None
        if self.n_fast:  # the fast tier first: on a GPU it runs while the CPU works
            f = int(torch.searchsorted(idx, torch.tensor(self.n_fast, dtype=idx.dtype)))
            fast = sparse_ffn_ref(xv.to(self.fast), self.fast_rows, idx[:f].to(self.fast),
                                  torch.empty(D, device=self.fast))
            idx = idx[f:]
        out = self._compute(xv.cpu(), idx, residual)
        if fast is not None:
            out = fast + out.to(self.fast)
        if self.down_bias is not None:
            out = out + self.down_bias.to(out.device)
        return out.to(x.dtype).reshape(B, T, D).to(x.device)

    def _rows_of(self, idx: Tensor, cut: int, slots: np.ndarray) -> Tensor:
        """Row numbers in ``self.rows`` of the neurons ``idx[:cut]`` (RAM) and of cold neurons
        in ``slots``, in the neurons' order: the kernel sums them as the all-in-RAM model does."""
        return torch.cat([(idx[:cut] - self.n_fast).to(torch.int32),
                          torch.from_numpy((slots + self._slot0).astype(np.int32))])

    @property
    def _slot0(self) -> int:
        """The row of ``self.rows`` that holds cache slot 0."""
        return self.n_ram - self.n_fast

    def _compute(self, xv: Tensor, idx: Tensor, residual: Tensor | None) -> Tensor:
        cut = int(torch.searchsorted(idx, torch.tensor(self.n_ram, dtype=idx.dtype)))
        cold = idx[cut:].numpy().astype(np.int64)
        if self.gates_first:
            return self._compute_gates_first(xv, idx, cut, cold, residual)
        cap = self.cache.capacity
        ticket = self.cache.request(cold[:cap])  # 1. the misses' reads start
        self._prefetch_next(residual)  # 2. the next layer's likely neurons, meanwhile
        slots = self.cache.complete(ticket)  # 3. wait for this layer's misses
        if cold.size <= cap:  # 4. one kernel call over RAM rows and cache slots
            return kernels.sparse_ffn(xv, self.rows, self._rows_of(idx, cut, slots), self._out)
        # more active cold neurons than slots: the cache's worth at a time
        out = kernels.sparse_ffn(xv, self.rows, self._rows_of(idx, cut, slots), self._out)
        for k in range(cap, cold.size, cap):
            slots = self.cache.complete(self.cache.request(cold[k:k + cap]))
            out += kernels.sparse_ffn(xv, self.cache.packed,
                                      torch.from_numpy(slots.astype(np.int32)), self._out_cold)
        return out

    def _compute_gates_first(self, xv: Tensor, idx: Tensor, cut: int, cold: np.ndarray,
                             residual: Tensor | None) -> Tensor:
        """Gates first (module docstring): a cold neuron's gate row comes from its cache slot
        if the cache holds it, else from a read of the file's gate rows (begun by the previous
        layer's look-ahead, or now) that does not go through the cache; the neurons whose gate
        fired take slots, their gate rows given, their up and down rows read."""
        from .. import cpu

        cache = self.cache
        slots = cache.slot_of[cold]
        held = slots >= 0  # in a slot
        in_ram = ~held & (cold < self.n_gate)  # gate row in RAM
        on_disk = ~held & ~in_ram
        gates = self._gate_rows(cold[on_disk])  # 1. the reads start
        self._prefetch_next(residual)  # 2. the next layer's gate rows, meanwhile
        cache.complete_slots(slots[held])  # (a read of the last token may still fill them)
        z = np.empty(cold.size, dtype=np.float32)
        if held.any():
            z[held] = kernels.gate_dots(xv, cache.packed,
                                        torch.from_numpy(slots[held].astype(np.int32))).numpy()
        if in_ram.any():
            z[in_ram] = cpu.sparse_q4_gates(
                self.gate_ram, torch.from_numpy((cold[in_ram] - self.n_ram).astype(np.int32)),
                xv).numpy()
        rows = gates.wait()  # 3. the gate rows read, in cold[on_disk]'s order
        if rows.shape[0]:
            r = torch.from_numpy(rows)
            z[on_disk] = cpu.sparse_q4_gates(r, torch.arange(r.shape[0], dtype=torch.int32),
                                             xv).numpy()
        on = z > 0.0
        fired = cold[on]
        # 4. the fired neurons' up/down rows through the cache, their gate rows given
        cap = cache.capacity
        given = [(self._gate_known, self.gate_ram.numpy()), (cold[on_disk], rows)]
        slots = cache.complete(cache.request(fired[:cap], given=given))
        if fired.size <= cap:
            # the whole active set with the neurons not fired masked out (their rows never
            # read: row 0 stands in): the same list as all in RAM, so the same sums
            rows_idx = torch.zeros(idx.numel(), dtype=torch.int32)
            rows_idx[:cut] = idx[:cut] - self.n_fast
            at = np.flatnonzero(on)
            rows_idx[cut + at] = torch.from_numpy((slots + self._slot0).astype(np.int32))
            mask = torch.ones(1, idx.numel(), dtype=torch.bool)
            mask[0, cut:] = torch.from_numpy(on)
            out = kernels.sparse_ffn_batch(xv.view(1, -1), self.rows, rows_idx,
                                           self._out.view(1, -1), mask)
            return out.view(-1)
        out = kernels.sparse_ffn(xv, self.rows, self._rows_of(idx, cut, slots), self._out)
        for k in range(cap, fired.size, cap):  # more fired neurons than slots
            slots = cache.complete(cache.request(fired[k:k + cap], given=given))
            out += kernels.sparse_ffn(xv, cache.packed,
                                      torch.from_numpy(slots.astype(np.int32)), self._out_cold)
        return out

    def _gate_rows(self, neurons: np.ndarray) -> GateRows:
        """The gate rows of ``neurons`` (ascending) from the file: those the look-ahead began
        reading, and one read for the rest."""
        ahead, self._ahead = self._ahead, None
        reader, layer = self.cache.reader, self.cache.layer
        if ahead is None:
            return GateRows(neurons, [reader.submit(layer, neurons, "gate")])
        rest = neurons[~np.isin(neurons, ahead.neurons, assume_unique=True)]
        batches = [ahead]
        if rest.size:
            batches.append(reader.submit(layer, rest, "gate"))
        return GateRows(neurons, batches)

    def _prefetch_next(self, residual: Tensor | None) -> None:
        nxt, norm = self._next
        if nxt is None or not self.prefetch_on or residual is None:
            return
        sel = nxt.selector
        r = residual.reshape(1, 1, -1)
        xin = r if norm is None else norm(r)
        with torch.no_grad():
            idx = sel.active(nxt, xin.reshape(-1).float().contiguous(), r)
        cold = idx.cpu().numpy().astype(np.int64)
        cold = cold[cold >= nxt.n_ram]
        st = nxt.prefetch_stats
        st.tokens += 1
        fresh = cold[nxt.cache.slot_of[cold] < 0]
        if nxt.gates_first:  # every predicted gate row not in RAM nor cached, read beside
            fresh = fresh[fresh >= nxt.n_gate]
        st.predicted += fresh.size
        if nxt.gates_first:
            nxt._ahead = nxt.cache.reader.submit(nxt.cache.layer, fresh, "gate")
            st.issued += fresh.size
            return
        limit = nxt.prefetch_limit if nxt.prefetch_limit is not None else nxt.cache.capacity // 2
        st.issued += nxt.cache.prefetch(fresh, limit)

    # ---- several tokens ------------------------------------------------------------------------

    def _batch(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """Each token's own active set (``masked`` and ``auto``, as SparseFFN), else the union
        of the sets (``union``; every neuron: ``dense`` or ``AllNeurons``); hot rows from RAM,
        cold ones through the cache."""
        B, T, D = x.shape
        dev = x.device  # the selector's (a fast device's, with three tiers); the rest on the CPU
        xd = x.float().reshape(B * T, D).contiguous()
        xf = xd.cpu()
        mask = None
        if isinstance(self.selector, AllNeurons) or self.batch_mode == "dense":
            idx = self._all
        else:
            r = None if residual is None else residual.float().reshape(B * T, D)
            mask = self.selector.mask(self, xd, r).cpu()
            idx = torch.nonzero(mask.any(dim=0)).reshape(-1).to(torch.int32)
        masked = mask is not None and self.batch_mode in ("masked", "auto")
        self.stats.tokens += B * T
        self.stats.active += int(mask.sum()) if masked else int(idx.numel()) * B * T
        def in_torch(packed: PackedFFN, rows_idx: Tensor, neurons: Tensor, xx: Tensor) -> Tensor:
            """The rows ``rows_idx`` of ``packed`` (neurons ``neurons``) in torch, on the
            rows' device, each token's own set when ``masked``."""
            rows = packed.rows_fp32(rows_idx.long())
            bias = None if packed.up_bias is None else packed.up_bias[rows_idx.long()]
            h = neuron_coefs(xx, packed, rows, bias)
            if masked:
                h = h * mask[:, neurons.long()].to(h.device)
            return h @ rows[:, -1]

        fast = None
        f = int(torch.searchsorted(idx, torch.tensor(self.n_fast, dtype=idx.dtype)))
        if f:  # the fast tier's neurons on its device, launched first
            fast = in_torch(self.fast_rows, idx[:f].to(self.fast), idx[:f], xd.to(self.fast))
        idx = idx[f:]
        cut = int(torch.searchsorted(idx, torch.tensor(self.n_ram, dtype=idx.dtype)))
        out = torch.zeros(B * T, D, dtype=torch.float32)
        tmp = torch.empty(B * T, D, dtype=torch.float32)

        def run(packed: PackedFFN, rows_idx: Tensor, neurons: Tensor) -> None:
            if rows_idx.numel() == 0:
                return
            if masked:  # each token's own set
                m = mask[:, neurons.long()].contiguous()
                out.add_(kernels.sparse_ffn_batch(xf, packed, rows_idx.to(torch.int32), tmp, m))
            else:
                out.add_(kernels.sparse_ffn_batch(xf, packed, rows_idx.to(torch.int32), tmp))

        cold = idx[cut:].numpy().astype(np.int64)
        cap = self.cache.capacity
        given = [(self._gate_known, self.gate_ram.numpy())]  # gate rows in RAM (gates first)
        slots = self.cache.complete(self.cache.request(cold[:cap], given=given))
        run(self.rows, self._rows_of(idx, cut, slots), idx[:cut + slots.size])
        for k in range(cap, cold.size, cap):
            chunk = cold[k:k + cap]
            slots = self.cache.complete(self.cache.request(chunk, given=given))
            run(self.cache.packed, torch.from_numpy(slots), torch.from_numpy(chunk))
        if fast is not None:
            out += fast.cpu()
        if self.down_bias is not None:
            out += self.down_bias
        return out.to(x.dtype).reshape(B, T, D).to(dev)


@dataclass
class DiskReport:
    """What the disk tier did since the last reset (for the CLI and the benchmark)."""

    tokens: int
    bytes_read: int
    reads: int
    cache: CacheStats
    prefetch_predicted: int
    prefetch_issued: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else float("nan")

    @property
    def prefetch_precision(self) -> float:
        """Share of prefetched neurons that were asked for before eviction."""
        return (self.cache.prefetch_used / self.cache.prefetched if self.cache.prefetched
                else float("nan"))


def disk_modules(model) -> list[DiskFFN]:
    return [b.ffn for b in model.layers if isinstance(b.ffn, DiskFFN)]


def disk_report(model) -> DiskReport | None:
    mods = disk_modules(model)
    if not mods:
        return None
    reader = mods[0].cache.reader
    cs = CacheStats()
    for m in mods:
        cs.add(m.cache.stats)
    # tokens: decode steps of the first layer (prefill batches count each token)
    return DiskReport(mods[0].stats.tokens, reader.bytes_read, reader.reads, cs,
                      sum(m.prefetch_stats.predicted for m in mods),
                      sum(m.prefetch_stats.issued for m in mods))


def reset_disk_stats(model) -> None:
    mods = disk_modules(model)
    for m in mods:
        m.cache.stats = CacheStats()
        m.prefetch_stats.__init__()
        m.stats.tokens = m.stats.active = 0
    if mods:
        mods[0].cache.reader.bytes_read = mods[0].cache.reader.reads = 0


def fill_disk_ffn(model, layer: int, src, plan, up_bias: Tensor | None,
                  down_bias: Tensor | None) -> None:
    """Fill layer ``layer``'s ``DiskFFN``: its RAM neurons read now, a cache over the file for
    the rest (one reader shared by every layer), linked to the layer after it for prefetch."""
    from ..sparse.ffn import packed_to_device
    from ..sparse.packed import DTYPES, empty_hugepages
    from .cache import EVICTION
    from .layout import copy_neurons, layout_of, read_packed
    from .reader import DEFAULT_GAP, NeuronReader

    dp = plan.sparse.disk
    ffn = model.layers[layer].ffn
    reader = getattr(model, "_disk_reader", None)
    if reader is None:
        gap = dp.options.read_gap  # None: measured when the load is done (measure_read_gap)
        reader = NeuronReader(layout_of(src), dp.options.io_threads, dp.options.direct,
                              max_gap=DEFAULT_GAP if gap is None else gap)
        model._disk_reader = reader  # one file descriptor and thread pool for every layer
    lay = reader.layout  # one layout (and position map) for every layer, not one each
    n, C = dp.ram_counts[layer], dp.cache_slots
    f = dp.fast_counts[layer] if dp.fast_counts else 0
    counted = reader.bytes_read, reader.reads
    fast = None
    if f:  # the fast tier's neurons [0, f), read here and moved to its device
        fast = packed_to_device(read_packed(src, layer, 0, f, up_bias, lay, reader), ffn.fast)
    # one rows tensor: the RAM neurons [f, n), then the cache's slots
    rows = empty_hugepages((n - f + C, lay.n_mats, lay.row_width), DTYPES[lay.dtype])
    copy_neurons(src, layer, f, n, rows[:n - f].numpy(), reader)
    g = dp.gate_counts[layer] if dp.gate_counts else n
    gate_rows = np.empty((g - n, lay.row_bytes), dtype=np.uint8)  # neurons [n, g): gates first
    copy_neurons(src, layer, n, g, gate_rows.reshape(g - n, 1, lay.row_bytes), reader,
                 parts=("gate",))
    reader.bytes_read, reader.reads = counted  # the load's reads are not the run's
    bias = None
    if up_bias is not None:
        bias = torch.zeros(n - f + C, dtype=torch.float32)
        bias[:n - f] = up_bias[f:n]
    packed = PackedFFN(lay.kind, lay.dtype, lay.d_model, n - f + C, rows, None, 0, bias)
    freq = src.extra_array(f"blk.{layer}.act_freq")
    cache = NeuronCache(lay, layer, reader, C, EVICTION[dp.options.eviction](), freq, up_bias,
                        rows[n - f:], None if bias is None else bias[n - f:])
    ffn.fill_disk(packed, cache, down_bias, gate_rows, fast)
    if layer > 0:
        prev = model.layers[layer - 1]
        if isinstance(prev.ffn, DiskFFN):
            blk = model.layers[layer]
            prev.ffn.link(ffn, blk.ffn_norm)


def measure_read_gap(model, plan) -> None:
    """The disk tier's read gap measured on the file (``NeuronReader.measure_gap``) when the
    plan leaves it open: after the load's own reads (the RAM neurons, the locked mapped
    weights), so none of them is in flight or owed to a throttle while the disk is timed."""
    reader = getattr(model, "_disk_reader", None)
    if reader is not None and plan.sparse.disk.options.read_gap is None:
        reader.max_gap = reader.measure_gap()


def _mapped(src, names):
    """(name, address, bytes) of the mapped file tensors ``names`` (canonical) that exist."""
    for name in names:
        t = src.tensors.get(name)
        if t is None or t.gguf is None:
            continue
        arr = np.asarray(t.raw())
        yield name, arr.__array_interface__["data"][0], arr.nbytes


def pin_mapped(src, names) -> int:
    """Lock the mapped pages of the file tensors ``names`` (canonical) in memory (``mlock``), so
    the kernel does not drop them when the memory limit is reached; returns the bytes locked.
    Best effort: a refused lock (no CAP_IPC_LOCK, RLIMIT_MEMLOCK) is logged, not raised."""
    import ctypes

    from ..fileio import libc

    lib = libc()
    if lib is None:
        return 0
    done = 0
    for name, addr, n in _mapped(src, names):
        if lib.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n)):
            log.warning("mlock of %s (%d MiB) refused (errno %d): it may be paged out under the "
                        "memory limit", name, n >> 20, ctypes.get_errno())
            break
        done += n
    log.info("locked %.0f MiB of mapped weights in memory", done / 2**20)
    return done


def read_by_rows(src, names) -> int:
    """Tell the kernel that the mapped file tensors ``names`` are read a row at a time
    (``MADV_RANDOM``: a page fault brings in its own page, not the read-around's 128 KiB), so a
    looked-up embedding row holds the pages the plan counts; returns the bytes advised."""
    from ..fileio import advise_random

    done = 0
    for _, addr, n in _mapped(src, names):
        done += n if advise_random(addr, n) else 0
    return done
