"""A layer's neuron cache: a fixed number of slots holding bundles read from disk.

The slots are one ``PackedFFN`` (``rows[slot]`` is a neuron's bundle), so the sparse kernels run
over cached neurons with slot numbers as indices. Which slot a new neuron evicts is a small
strategy object (``EVICTION``):

- ``LRU``: the least recently used neuron (LLM in a Flash's sliding window keeps the neurons of
  the last tokens, which is the same idea at the granularity of single neurons);
- ``FrequencyAware``: the neuron the profile says fires least often (the file's
  ``blk.N.act_freq``), ties broken by recency: the cache then holds the warmest of the cold
  neurons rather than the most recent ones.

Reads are asynchronous: ``request`` starts the reads of the misses and returns a ``Ticket``;
``complete`` waits and returns the slots. ``prefetch`` starts reads for neurons a later layer is
likely to need (their slots are pending: never evicted, and waited for when asked for). A part
of a neuron's rows counts as held only after it was read in full.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..sparse.packed import DTYPES, PackedFFN, empty_hugepages
from .layout import BundleLayout
from .reader import NeuronReader, ReadBatch

log = logging.getLogger(__name__)

EMPTY, VALID, PENDING = 0, 1, 2


class Eviction:
    """Which slots to give up: ``keys`` per slot, lowest evicted first."""

    name = "?"

    def keys(self, cache: NeuronCache) -> np.ndarray:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class LRU(Eviction):
    name = "lru"

    def keys(self, cache):
        return cache.last_use.astype(np.float64)


class FrequencyAware(Eviction):
    name = "freq"

    def keys(self, cache):
        # profiled firing rate first; among equals, the least recently used goes
        return cache.freq_of_slot + cache.last_use * 1e-12


EVICTION = {"lru": LRU, "freq": FrequencyAware}


@dataclass
class CacheStats:
    requested: int = 0  # cold neurons asked for
    hits: int = 0  # found valid in the cache
    prefetch_hits: int = 0  # found because a prefetch had (or was) reading them
    misses: int = 0  # read on demand
    prefetched: int = 0  # neurons a prefetch read
    prefetch_used: int = 0  # of those, asked for before being evicted

    def add(self, o: CacheStats) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(o, k))

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.prefetch_hits) / self.requested if self.requested else float("nan")


@dataclass
class Ticket:
    neurons: np.ndarray
    slots: np.ndarray


class NeuronCache:
    """``capacity`` slots for one layer's cold neurons (global neuron numbers ``>= first``).

    A slot holds a neuron's rows as they come: with the gates apart in the file
    (``BundleLayout.gates_apart``) its gate row may be there without its up and down rows
    (``has``: a bit per file part, ``layout.parts`` in order; ``ALL`` the whole neuron)."""

    def __init__(self, layout: BundleLayout, layer: int, reader: NeuronReader, capacity: int,
                 eviction: Eviction, act_freq: np.ndarray | None = None,
                 up_bias: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        """``rows`` / ``bias``: the slots' storage when the caller provides it (``DiskFFN`` puts
        the slots right after the RAM neurons, so one kernel call covers both)."""
        self.layout, self.layer, self.reader = layout, layer, reader
        self.capacity = int(capacity)
        self.eviction = eviction
        C, F = self.capacity, layout.d_ff
        if rows is None:
            rows = empty_hugepages((C, layout.n_mats, layout.row_width), DTYPES[layout.dtype])
        self._up_bias = up_bias
        if bias is None and up_bias is not None:
            bias = torch.zeros(C, dtype=torch.float32)
        self.packed = PackedFFN(layout.kind, layout.dtype, layout.d_model, C, rows, None, 0, bias)
        self._bytes = rows.view(torch.uint8).reshape(C, -1).numpy()
        self.parts = list(layout.parts)  # bit i of has: parts[i]
        self.ALL = (1 << len(self.parts)) - 1
        self.slot_of = np.full(F, -1, dtype=np.int64)
        self.neuron_of = np.full(C, -1, dtype=np.int64)
        self.has = np.zeros(C, dtype=np.int8)  # parts read in full
        self.coming = np.zeros(C, dtype=np.int8)  # parts being read
        self.by_prefetch = np.zeros(C, dtype=bool)  # filled by a prefetch, not yet asked for
        self.last_use = np.zeros(C, dtype=np.int64)
        freq = np.zeros(F) if act_freq is None else np.asarray(act_freq, dtype=np.float64)
        self._freq = freq
        self.freq_of_slot = np.full(C, -1.0)
        self.tick = 0
        self.pending: list[tuple[ReadBatch, np.ndarray]] = []
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def bit(self, part: str) -> int:
        """``has``'s bit of the file part ``part``."""
        return 1 << self.parts.index(part)

    @property
    def state(self) -> np.ndarray:
        """Per slot: EMPTY, PENDING (a read in flight: never evicted) or VALID (what it holds
        was read in full)."""
        st = np.where(self.neuron_of >= 0, VALID, EMPTY).astype(np.int8)
        st[self.coming != 0] = PENDING
        return st

    # ---- slots ---------------------------------------------------------------------------------

    def _take(self, k: int, protect: np.ndarray) -> np.ndarray:
        """``k`` slots to (re)fill: empty ones first, then the eviction order; never a slot
        being read nor one in ``protect``."""
        def keys() -> np.ndarray:
            k_ = self.eviction.keys(self).copy()
            k_[self.neuron_of < 0] = -np.inf
            k_[self.coming != 0] = np.inf
            k_[protect] = np.inf
            return k_

        keys_ = keys()
        if int(np.sum(keys_ < np.inf)) < k:
            self._drain()  # pending prefetches end; their slots become evictable
            keys_ = keys()
        if int(np.sum(keys_ < np.inf)) < k:
            raise ValueError(f"neuron cache: {k} slots needed, {self.capacity} in all")
        slots = np.argpartition(keys_, k - 1)[:k]
        old = self.neuron_of[slots]
        self.slot_of[old[old >= 0]] = -1
        self.neuron_of[slots] = -1
        self.has[slots] = 0
        self.by_prefetch[slots] = False
        return slots

    def _assign(self, slots: np.ndarray, neurons: np.ndarray) -> None:
        self.neuron_of[slots] = neurons
        self.slot_of[neurons] = slots
        self.freq_of_slot[slots] = self._freq[neurons]
        self.last_use[slots] = self.tick

    def _read(self, neurons: np.ndarray, slots: np.ndarray, want: int) -> None:
        """Start reading the parts in ``want`` of ``neurons`` (sorted) into ``slots``; the reads
        are pending until committed."""
        for i, part in enumerate(self.parts):
            if want >> i & 1:
                batch = self.reader.submit(self.layer, neurons, part)
                self.coming[slots] |= np.int8(1 << i)
                self.pending.append((batch, slots))

    def _commit(self, batch: ReadBatch, slots: np.ndarray) -> None:
        """Wait for one read and put its rows in their slots."""
        self.pending = [e for e in self.pending if e[0] is not batch]
        b = np.int8(self.bit(batch.part.name))
        self.coming[slots] &= ~b
        live = self.neuron_of[slots] == batch.neurons  # (always: slots being read are kept)
        try:
            rows = batch.wait()
        except Exception:
            # nothing half-read stays: the slots go back to empty
            self.slot_of[batch.neurons[live]] = -1
            self.neuron_of[slots[live]] = -1
            self.has[slots[live]] = 0
            raise
        lo = batch.part.first_mat * self.layout.row_bytes
        self._bytes[slots[live], lo:lo + batch.part.nbytes] = rows[live]
        if self._up_bias is not None:
            self.packed.up_bias[torch.from_numpy(slots[live])] = \
                self._up_bias[torch.from_numpy(batch.neurons[live])]
        self.has[slots[live]] |= b

    def _drain(self) -> None:
        for batch, slots in list(self.pending):
            self._commit(batch, slots)

    def _wait_for(self, slots: np.ndarray) -> None:
        """Commit the pending reads that fill any of ``slots``."""
        want = np.zeros(self.capacity, dtype=bool)
        want[slots] = True
        for batch, bslots in list(self.pending):
            if want[bslots].any():
                self._commit(batch, bslots)

    # ---- the runtime's calls -------------------------------------------------------------------

    def request(self, neurons: np.ndarray,
                given: list[tuple[np.ndarray, np.ndarray]] | None = None) -> Ticket:
        """Start making ``neurons`` (unique global indices, at most ``capacity``) resident.
        ``given``: gate rows at hand (gates first), (neurons ascending, their rows ``[n, row
        bytes]``) each, copied into the slots of those that need one instead of being read."""
        if neurons.size > self.capacity:
            raise ValueError(f"neuron cache: {neurons.size} neurons asked for at once, "
                             f"capacity {self.capacity}")
        self.tick += 1
        st = self.stats
        st.requested += neurons.size
        slots = self.slot_of[neurons]
        cached = slots >= 0
        cs = slots[cached]
        pre = self.by_prefetch[cs]
        st.prefetch_hits += int(pre.sum())
        st.prefetch_used += int(pre.sum())
        st.hits += int(cs.size - pre.sum())
        self.by_prefetch[cs] = False
        self.last_use[cs] = self.tick
        miss = neurons[~cached]
        st.misses += miss.size
        if miss.size:
            protect = np.zeros(self.capacity, dtype=bool)
            protect[cs] = True
            new = self._take(miss.size, protect)
            self._assign(new, miss)
            for known, rows in given or ():
                if known.size:
                    self._give_gates(miss, new, known, rows)
            slots = self.slot_of[neurons]
        # the parts no slot holds or is reading (a new neuron: every part, less a given gate row)
        lacking = self.ALL & ~(self.has[slots] | self.coming[slots])
        for i in range(len(self.parts)):
            sel = (lacking >> i & 1).astype(bool)
            if sel.any():
                order = np.argsort(neurons[sel])
                self._read(neurons[sel][order], slots[sel][order], 1 << i)
        return Ticket(neurons, slots)

    def _give_gates(self, neurons: np.ndarray, slots: np.ndarray, known: np.ndarray,
                    rows: np.ndarray) -> None:
        """Copy the gate rows of ``neurons`` found in ``known`` (ascending; ``rows`` theirs)
        into their new ``slots``."""
        pos = np.searchsorted(known, neurons)
        pos[pos >= known.size] = 0
        found = known[pos] == neurons
        if found.any():
            n = self.layout.row_bytes
            self._bytes[slots[found], :n] = rows[pos[found]]
            self.has[slots[found]] |= np.int8(self.bit("gate"))

    def complete_slots(self, slots: np.ndarray) -> None:
        """Wait for the reads (prefetches too) that fill any of ``slots``."""
        self._wait_for(slots)

    def complete(self, ticket: Ticket) -> np.ndarray:
        """Wait for the reads that fill ``ticket``'s slots (its own and any prefetch's); returns
        the slots of its neurons (valid rows)."""
        self._wait_for(ticket.slots)
        return ticket.slots

    def prefetch(self, neurons: np.ndarray, limit: int) -> int:
        """Start reading up to ``limit`` of ``neurons`` not yet cached; returns how many."""
        miss = neurons[self.slot_of[neurons] < 0][:limit]
        free = int(np.sum(self.coming == 0))
        miss = miss[: max(0, min(free, self.capacity // 2))]
        if miss.size == 0:
            return 0
        slots = self._take(miss.size, np.zeros(self.capacity, dtype=bool))
        order = np.argsort(miss)
        miss, slots = miss[order], slots[order]
        self._assign(slots, miss)
        self.by_prefetch[slots] = True
        self._read(miss, slots, self.ALL)
        self.stats.prefetched += miss.size
        return miss.size
