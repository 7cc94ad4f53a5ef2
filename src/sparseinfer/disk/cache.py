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
likely to need (their slots are marked pending: they are never evicted, and are waited for when
asked for). A slot is marked valid only after its bundle was read in full.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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
    batch: ReadBatch | None
    new_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class NeuronCache:
    """``capacity`` slots for one layer's cold neurons (global neuron numbers ``>= first``)."""

    def __init__(self, layout: BundleLayout, layer: int, reader: NeuronReader, capacity: int,
                 eviction: Eviction, act_freq: np.ndarray | None = None,
                 up_bias: torch.Tensor | None = None):
        self.layout, self.layer, self.reader = layout, layer, reader
        self.capacity = int(capacity)
        self.eviction = eviction
        C, F = self.capacity, layout.d_ff
        rows = empty_hugepages((C, layout.n_mats, layout.row_width), DTYPES[layout.dtype])
        self._up_bias = up_bias
        bias = None if up_bias is None else torch.zeros(C, dtype=torch.float32)
        self.packed = PackedFFN(layout.kind, layout.dtype, layout.d_model, C, rows, None, 0, bias)
        self._bytes = rows.view(torch.uint8).reshape(C, -1).numpy()
        self.slot_of = np.full(F, -1, dtype=np.int64)
        self.neuron_of = np.full(C, -1, dtype=np.int64)
        self.state = np.zeros(C, dtype=np.int8)
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

    # ---- slots ---------------------------------------------------------------------------------

    def _take(self, k: int, protect: np.ndarray) -> np.ndarray:
        """``k`` slots to (re)fill: empty ones first, then the eviction order; never a pending
        slot nor one in ``protect``."""
        def keys() -> np.ndarray:
            k_ = self.eviction.keys(self).copy()
            k_[self.state == EMPTY] = -np.inf
            k_[self.state == PENDING] = np.inf
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
        self.state[slots] = EMPTY
        self.by_prefetch[slots] = False
        return slots

    def _assign(self, slots: np.ndarray, neurons: np.ndarray, state: int) -> None:
        self.neuron_of[slots] = neurons
        self.slot_of[neurons] = slots
        self.state[slots] = state
        self.freq_of_slot[slots] = self._freq[neurons]
        self.last_use[slots] = self.tick

    def _commit(self, batch: ReadBatch, slots: np.ndarray) -> None:
        try:
            rows = batch.wait()
        except Exception:
            # nothing half-read stays: the slots go back to empty
            live = self.neuron_of[slots] == batch.neurons
            self.slot_of[batch.neurons[live]] = -1
            self.state[slots[live]] = EMPTY
            self.neuron_of[slots[live]] = -1
            raise
        live = self.neuron_of[slots] == batch.neurons  # (always: pending slots are kept)
        self._bytes[slots[live]] = rows[live]
        if self._up_bias is not None:
            self.packed.up_bias[torch.from_numpy(slots[live])] = \
                self._up_bias[torch.from_numpy(batch.neurons[live])]
        self.state[slots[live]] = VALID

    def _drain(self) -> None:
        pending, self.pending = self.pending, []
        for batch, slots in pending:
            self._commit(batch, slots)

    def _wait_for(self, slots: np.ndarray) -> None:
        """Commit the pending reads that fill any of ``slots``."""
        want = np.zeros(self.capacity, dtype=bool)
        want[slots] = True
        keep = []
        for batch, bslots in self.pending:
            if want[bslots].any():
                self._commit(batch, bslots)
            else:
                keep.append((batch, bslots))
        self.pending = keep

    # ---- the runtime's calls -------------------------------------------------------------------

    def request(self, neurons: np.ndarray) -> Ticket:
        """Start making ``neurons`` (unique global indices, at most ``capacity``) resident."""
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
        batch, new = None, np.zeros(0, np.int64)
        if miss.size:
            protect = np.zeros(self.capacity, dtype=bool)
            protect[cs] = True
            new = self._take(miss.size, protect)
            order = np.argsort(miss)
            miss, new = miss[order], new[order]
            self._assign(new, miss, PENDING)
            batch = self.reader.submit(self.layer, miss)
            slots = self.slot_of[neurons]
        return Ticket(neurons, slots, batch, new)

    def complete(self, ticket: Ticket) -> np.ndarray:
        """Wait for ``ticket``'s reads; returns the slots of its neurons (valid rows)."""
        if ticket.batch is not None:
            self._commit(ticket.batch, ticket.new_slots)
        self._wait_for(ticket.slots)
        return ticket.slots

    def prefetch(self, neurons: np.ndarray, limit: int) -> int:
        """Start reading up to ``limit`` of ``neurons`` not yet cached; returns how many."""
        miss = neurons[self.slot_of[neurons] < 0][:limit]
        free = int(np.sum(self.state != PENDING))
        miss = miss[: max(0, min(free, self.capacity // 2))]
        if miss.size == 0:
            return 0
        slots = self._take(miss.size, np.zeros(self.capacity, dtype=bool))
        miss = np.sort(miss)
        self._assign(slots, miss, PENDING)
        self.by_prefetch[slots] = True
        self.pending.append((self.reader.submit(self.layer, miss), slots))
        self.stats.prefetched += miss.size
        return miss.size
