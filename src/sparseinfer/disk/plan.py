"""``--ram-budget``: what stays in RAM and what is read from the file.

The budget counts every byte the process holds: the Python/torch runtime as it stands when the
plan is made (its resident set, plus a margin), every planned weight that is not a sparse FFN
(the mapped ones included: their pages sit in the page cache, which a cgroup limit counts), the
predictors, the KV cache for the context, the reader's buffers and the neuron caches. What is
left goes to FFN neurons in RAM, split between

- a static hot prefix per layer, placed by the same ILP as the GPU placement
  (``offline/solve.py``, with RAM as the fast tier and the file's ``blk.N.act_freq`` as
  frequencies: it maximises the activation mass in RAM), and
- per-layer neuron caches (``cache_share`` of the neurons' bytes, equal slots per layer) for the
  cold neurons read from disk.

With the gate rows apart in the file and a ReLU gate (gates first: ``tier.py``), gate rows in RAM
come first: every predicted neuron's gate is computed, but only the fired ones' up and down rows
are read, and the predictors select several times more neurons than fire (benchmarks/RESULTS.md),
so a gate row saves more bytes read per byte of RAM than a neuron's up and down rows do. The
hottest neurons' gate rows of every layer (a prefix, as the file stores neurons hottest first)
take the room less the smallest caches; only when every gate row fits does the rest go to the
hot prefix and the caches as above.

With a fast device (``--vram-budget``: three tiers), its hot prefix per layer is placed first
(``models/plan.py``'s ILP, which counts attention and embeddings in VRAM); RAM takes the hottest
neurons after it, and the attention, LM head, predictors and KV cache, being on the device, are
not counted in RAM.

The placement is made at load time from the file's statistics (no offline step: the budget is
a property of the machine, not of the model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from ..errors import SparseInferError
from ..fileio import PAGE
from .cache import EVICTION
from .layout import layout_of, relu_gated
from .reader import ALIGN, MAX_RUN

log = logging.getLogger(__name__)

GIB = 1 << 30
MIN_SLOTS = 256  # cache slots per layer at the least, when the budget is short
MAPPED = ("ggml", "file")  # storages read in place from the mapped file (page cache)
PAGED_SHARE = 0.1  # of the room for mapped weights, left to the pages the kernel re-reads
# bytes on top of the measured runtime: temporaries, logits, allocator slack, library code first
# run after the plan (benchmarks/RESULTS.md: what a 13B run held beyond its plan)
MARGIN = 192 << 20


@dataclass(frozen=True)
class DiskOptions:
    """How the disk tier runs (``--ram-budget`` and the benchmark's knobs)."""

    cache_share: float = 0.25  # of the neurons' RAM, held by the caches (the rest: hot prefix)
    eviction: str = "lru"  # key of cache.EVICTION
    # reads in flight: many small reads (a gate row is a few KiB) need a deep queue to keep a
    # slow disk streaming; a fast one is flat from 8 to 32 (benchmarks/RESULTS.md)
    io_threads: int = 32
    # unwanted rows a read may pass over between two wanted ones: one read of a few more KiB
    # costs less than a second read on a fast SSD, more on a slow disk (RESULTS.md). None:
    # measured on the file at load (NeuronReader.measure_gap)
    read_gap: int | None = None
    prefetch: bool = True
    direct: bool = True  # O_DIRECT reads
    pin: bool = True  # lock the mapped weights read every token (mlock) within the budget
    process_bytes: int | None = None  # the runtime's own bytes (None: measured now)
    ram_counts: tuple[int, ...] | None = None  # tests: neurons in RAM per layer, no budget
    gate_counts: tuple[int, ...] | None = None  # tests: neurons whose gate rows are in RAM
    cache_slots: int | None = None  # tests: slots per layer, no budget

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION:
            raise SparseInferError(f"cache eviction: expected one of {sorted(EVICTION)}, got "
                                   f"{self.eviction!r}")
        if not 0.0 <= self.cache_share < 1.0:
            raise SparseInferError(f"cache share: expected a fraction in [0, 1), got "
                                   f"{self.cache_share}")


@dataclass(frozen=True)
class DiskPlan:
    budget_bytes: int  # 0 with explicit counts
    ram_counts: tuple[int, ...]  # per layer: neurons [0, n) in RAM
    cache_slots: int  # per layer
    neuron_bytes: int  # one bundle in RAM
    parts: tuple[tuple[str, int], ...]  # what the budget holds, by part
    options: DiskOptions
    pinned: tuple[str, ...] = ()  # mapped tensors (canonical names) locked in memory (mlock)
    paged_bytes: int = 0  # mapped weights left to the kernel: re-read per token when short
    # per layer: neurons [0, g) have their gate rows in RAM (gates first; g >= ram_counts)
    gate_counts: tuple[int, ...] = ()
    # mapped tensors read a row at a time (an embedding no LM head reads whole): the kernel is
    # told so (no read-around), and the budget counts the pages of a context's rows
    by_rows: tuple[str, ...] = ()
    # per layer: neurons [0, f) on the fast device (three tiers: f <= ram_counts), () for none
    fast_counts: tuple[int, ...] = ()

    def summary(self) -> str:
        gates = sum(self.gate_counts) - sum(self.ram_counts) if self.gate_counts else 0
        fast = sum(self.fast_counts)
        lines = ["  disk tier: "
                 + (f"{fast} neurons on the fast device, " if fast else "")
                 + f"{sum(self.ram_counts) - fast} neurons in RAM"
                 + (f" and {gates} more neurons' gate rows" if gates else "")
                 + f", {self.cache_slots} cache slots per layer ({self.options.eviction}), "
                   f"prefetch {'on' if self.options.prefetch else 'off'}"]
        if self.budget_bytes:
            lines.append(f"  --ram-budget {self.budget_bytes / GIB:.2f} GiB = " + ", ".join(
                f"{n} {b / 2**20:.0f} MiB" for n, b in self.parts))
        if self.pinned or self.paged_bytes:
            lines.append(f"  mapped weights: {len(self.pinned)} tensors locked in memory, "
                         f"{self.paged_bytes / 2**20:.0f} MiB paged by the kernel")
        return "\n".join(lines)


def resident_bytes() -> int:
    """This process's own memory now: anonymous, shared and file-backed resident pages
    (``/proc/self/status``). The file pages are mostly library code (torch's alone is tens of
    MiB): the kernel could drop them, but they are run every token, and a cgroup limit counts
    them; the model file's header pages are among them too. 0 where unknown."""
    total = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:", "RssFile:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def rows_held(w, n_ctx: int | None) -> int:
    """The bytes of the mapped weight ``w``, read a row at a time, that ``n_ctx`` tokens' rows
    bring into memory: a row's pages (one more where it straddles a page edge) per token, the
    whole tensor at most (or without a context)."""
    if n_ctx is None:
        return w.nbytes
    row = -(-w.nbytes // max(1, w.shape[0]))
    return min(w.nbytes, n_ctx * (-(-row // PAGE) + 1) * PAGE)


def plan_disk(src, sparse, weights, kv_bytes: int, budget_gib: float | None,
              options: DiskOptions, n_ctx: int | None = None,
              fast_counts: tuple[int, ...] | None = None,
              dense_in_ram: bool = True) -> tuple[DiskPlan, list]:
    """The disk plan, and ``weights`` with each sparse FFN's bytes set to what stays in RAM.
    ``n_ctx``: the context, for the pages of the embedding rows its tokens look up (None: the
    whole embedding is counted). ``fast_counts``: per layer, the hot prefix on the fast device
    (``--vram-budget``'s placement; None: no fast tier): RAM takes the hottest neurons after it.
    ``dense_in_ram``: the attention, LM head, norms and predictors are in RAM (False: they live
    on the fast device, and the budget does not count them)."""
    from ..offline.solve import PlacementProblem, solve_placement

    cfg = src.config
    lay = layout_of(src)
    if sparse.selector == "oracle":
        raise SparseInferError("--ram-budget: the oracle selector needs every neuron's rows; "
                               "use --sparse-mode predictor or all")
    if sparse.ffn_dtype != lay.dtype:
        raise SparseInferError(f"--ram-budget: the file's bundles are {lay.dtype} rows; "
                               f"expected --ffn-dtype {lay.dtype}, got {sparse.ffn_dtype}")
    nb = lay.bundle_bytes
    ffn_rows = cfg.d_ff * nb
    # the sparse weight's bytes besides its rows: predictors (and biases)
    others = sum(w.nbytes for w in weights if w.storage != "sparse")
    preds = sum(max(0, w.nbytes - ffn_rows) for w in weights if w.storage == "sparse")
    io = options.io_threads * (MAX_RUN * lay.stride + 2 * ALIGN)
    gates_first = lay.gates_apart and relu_gated(lay.kind) and lay.dtype == "q4"
    if gates_first:  # two layers' gate rows being read
        io += 2 * cfg.d_ff * lay.row_bytes
    gate_counts: tuple[int, ...] = ()
    fast = tuple(int(f) for f in (fast_counts or (0,) * cfg.n_layers))
    if len(fast) != cfg.n_layers or any(not 0 <= f <= cfg.d_ff for f in fast):
        raise SparseInferError(f"fast tier: expected {cfg.n_layers} counts in [0, {cfg.d_ff}], "
                               f"got {fast}")
    if options.ram_counts is not None or options.cache_slots is not None:
        counts = tuple(options.ram_counts or fast)
        if len(counts) != cfg.n_layers or any(not f <= c <= cfg.d_ff
                                               for f, c in zip(fast, counts)):
            raise SparseInferError(f"ram counts: expected {cfg.n_layers} counts from the fast "
                                   f"tier's {fast} to {cfg.d_ff}, got {counts}")
        if options.gate_counts is not None:
            gate_counts = tuple(options.gate_counts)
            if not gates_first or len(gate_counts) != cfg.n_layers or any(
                    not c <= g <= cfg.d_ff for c, g in zip(counts, gate_counts)):
                raise SparseInferError(f"gate counts: expected a file with the gate rows apart "
                                       f"and {cfg.n_layers} counts from the RAM counts to "
                                       f"{cfg.d_ff}, got {gate_counts}")
        slots = int(options.cache_slots or max(1, cfg.d_ff // 8))
        budget, parts = 0, ()
    else:
        if budget_gib is None or budget_gib <= 0:
            raise SparseInferError(f"--ram-budget: expected GiB > 0, got {budget_gib}")
        budget = int(budget_gib * GIB)
        runtime = (resident_bytes() if options.process_bytes is None
                   else options.process_bytes)
        runtime += MARGIN if options.process_bytes is None else 0
        mapped_w = [w for w in weights if w.storage in MAPPED and w.nbytes]
        # a mapped embedding no LM head reads whole: one row per token, left to the kernel
        read_whole = {s_ for w in weights if w.storage == "ggml" for s_ in w.sources}
        row_w = [w for w in mapped_w if w.storage == "file"
                 and not read_whole.intersection(w.sources)]
        by_rows = tuple(s_ for w in row_w for s_ in w.sources)
        mapped = sum(w.nbytes for w in mapped_w if w not in row_w)
        dense = others - mapped - sum(w.nbytes for w in row_w)
        if not dense_in_ram:  # on the fast device
            mapped_w = [w for w in mapped_w if w in row_w]
            dense = mapped = preds = 0
        fixed = [("runtime", runtime), ("weights", dense), ("mapped_weights", mapped),
                 ("embedding_rows", sum(rows_held(w, n_ctx) for w in row_w)),
                 ("predictors", preds), ("kv_cache", kv_bytes), ("io_buffers", io)]
        room = budget - sum(b for _, b in fixed)
        # read whole every token: locked in memory, so the kernel never drops them for a page
        # the FFN or a neighbour wants
        lockable = [w for w in mapped_w if w.storage == "ggml"]
        pinned = [s_ for w in lockable for s_ in w.sources]
        paged = 0
        min_cache = min(cfg.d_ff, MIN_SLOTS) * cfg.n_layers * nb
        if room < cfg.n_layers * nb:  # not one cache slot per layer left
            anon = sum(b for n, b in fixed if n != "mapped_weights")
            if budget - anon < min_cache:
                raise SparseInferError(
                    f"--ram-budget {budget_gib:g} GiB: the parts every token needs take "
                    + ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in fixed)
                    + f" ({sum(b for _, b in fixed) / GIB:.2f} GiB), leaving no room for FFN "
                      f"neurons; expected at least {(anon + min_cache) / GIB:.2f} GiB "
                      f"(or a smaller -c)")
            # the mapped weights do not all fit: lock what fits (the LM head first, then the
            # layers in order) and leave the rest to the kernel, which re-reads those pages every
            # token; the FFN runs from the disk tier with the smallest caches
            free = int((budget - anon - min_cache) * (1 - PAGED_SHARE))
            pinned, held = [], 0
            for w in sorted(lockable, key=lambda w: w.module != "lm_head"):
                if held + w.nbytes <= free:
                    pinned += list(w.sources)
                    held += w.nbytes
            paged = mapped - held
            log.warning("--ram-budget %.2f GiB: the mapped weights (attention, LM head: "
                        "%.2f GiB) do not all fit beside the rest (the KV cache for the "
                        "context alone takes %.2f GiB: a smaller -c leaves more): %.2f GiB "
                        "locked in memory, %.2f GiB re-read from the file by the kernel every "
                        "token; every FFN neuron is read from disk", budget_gib, mapped / GIB,
                        kv_bytes / GIB, held / GIB, paged / GIB)
            room = min_cache
            share = 1.0  # all of it caches: no neuron stays in RAM for good
        else:
            share = options.cache_share
        gate_bytes = 0
        if gates_first and room > min_cache:  # gate rows first (module docstring)
            k = (room - min_cache) // (cfg.n_layers * lay.row_bytes)
            gate_counts = tuple(int(min(cfg.d_ff, f + k)) for f in fast)
            gate_bytes = (sum(gate_counts) - sum(fast)) * lay.row_bytes
            room -= gate_bytes
            if min(gate_counts) < cfg.d_ff:
                share = 1.0  # the rest is the smallest caches
        slots = max(1, int(room * share) // (cfg.n_layers * nb))
        slots = min(slots, cfg.d_ff)
        freqs = []
        for i in range(cfg.n_layers):
            f = src.extra_array(f"blk.{i}.act_freq")
            if f is None:
                raise SparseInferError(f"{src.path}: sparse model is missing tensor "
                                       f"'blk.{i}.act_freq'")
            freqs.append(np.clip(np.asarray(f, dtype=np.float64)[fast[i]:], 0.0, 1.0))
        hot_room = room - slots * cfg.n_layers * nb
        # a hot neuron's gate row is in RAM already when every gate row is
        hot_nb = nb - lay.row_bytes if gate_bytes else nb
        live = [i for i in range(cfg.n_layers) if freqs[i].size]  # (not all on the fast tier)
        sol = solve_placement(PlacementProblem(tuple(freqs[i] for i in live),
                                               (hot_nb,) * len(live), hot_room, (),
                                               min_split_neurons=0)) if live else None
        more = dict(zip(live, sol.hot_counts)) if live else {}
        counts = tuple(f + int(more.get(i, 0)) for i, f in enumerate(fast))
        if gate_counts:  # (a hot neuron holds its gate row)
            gate_counts = tuple(max(g, c) for g, c in zip(gate_counts, counts))
        # what the solver's groups of neurons left over goes to the caches
        left = hot_room - (sum(counts) - sum(fast)) * hot_nb
        slots = min(cfg.d_ff, slots + left // (cfg.n_layers * nb))
        # the solver picks each layer's hottest neurons; the file stores them first
        for i, h in zip(live, sol.hot if live else ()):
            if h.size and int(h.max()) != h.size - 1:
                log.info("layer %d: frequency ties reorder the hot set; the stored prefix of "
                         "%d neurons is kept", i, h.size)
        parts = (*fixed, ("gate_rows", gate_bytes),
                 ("hot_neurons", (sum(counts) - sum(fast)) * hot_nb),
                 ("neuron_caches", slots * cfg.n_layers * nb))
    slots = max(1, min(slots, cfg.d_ff - min(counts)))  # no more slots than cold neurons
    if budget:
        parts = (*parts[:-1], ("neuron_caches", slots * cfg.n_layers * nb))
    if not budget:
        pinned, paged, by_rows = [], 0, ()
    dp = DiskPlan(budget, counts, slots, nb, parts, options, tuple(pinned) if options.pin else (),
                  paged, gate_counts, by_rows, fast)
    new_weights = []
    for w in weights:
        if w.storage == "sparse":
            i = int(w.module.split(".")[1])
            gates = (gate_counts[i] - counts[i]) * lay.row_bytes if gate_counts else 0
            held = (counts[i] - fast[i] + slots) * nb + gates + max(0, w.nbytes - ffn_rows)
            w = replace(w, nbytes=held, origin=f"{lay.dtype} rows, disk tier")
        new_weights.append(w)
    log.info("disk plan: %s", dp.summary())
    return dp, new_weights
