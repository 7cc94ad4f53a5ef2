"""Where each neuron's bundle sits in the file: neurons that fire together, side by side.

The reader turns a run of neighbouring bundles into one read (``reader.py``), and a disk with
the reads of a token in flight is bound by how many reads there are, not by their bytes (the
reads are a few KiB each: see RESULTS.md). So the file order matters: in the hot-first order the
exporter writes, the cold neurons one token needs are scattered and nearly every one is its own
read. "LLM in a Flash" (Alizadeh et al., 2023) bundles each neuron's rows and suggests placing
co-activated neurons together; this module does that from activation masks.

The order is a greedy path through the co-activation graph: start at the hottest neuron, step to
the unvisited neuron that fired together with the current one most often, and when none did, to
the hottest unvisited one. Two neighbours that fire together on a token save one read on that
token, so the path's weight (co-activations of neighbours) is the reads it saves on the profiled
tokens. Any order is exact: the file stores where each neuron went (``blk.N.ffn_bundle_pos``),
and the runtime reads by that map.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_TOKENS = 2048  # tokens of masks used at most (the co-activation matmul grows with them)


def coactivation_order(masks: np.ndarray, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """File order (neuron ids, a permutation of ``range(F)``) from ``masks`` ``[T, F]`` (bool or
    0/1: neuron f active on token t)."""
    m = np.asarray(masks)
    if m.ndim != 2:
        raise ValueError(f"masks: expected [tokens, neurons], got shape {m.shape}")
    T, F = m.shape
    if T > max_tokens:  # evenly spaced tokens: deterministic
        m = m[np.linspace(0, T - 1, max_tokens).round().astype(np.int64)]
    x = torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32))
    co = (x.T @ x).numpy()  # [F, F] co-activation counts (exact in float32 below 2^24 tokens)
    freq = np.diag(co).copy()
    np.fill_diagonal(co, 0.0)
    by_freq = np.argsort(-freq, kind="stable")
    visited = np.zeros(F, dtype=bool)
    order = np.empty(F, dtype=np.int64)
    row = np.empty(F, dtype=np.float32)
    nxt_hot = 0  # position in by_freq of the hottest neuron maybe unvisited
    cur = int(by_freq[0])
    for k in range(F):
        order[k] = cur
        visited[cur] = True
        if k == F - 1:
            break
        np.copyto(row, co[cur])
        row[visited] = -1.0  # never chosen again
        best = int(np.argmax(row))
        if row[best] > 0:
            cur = best
            continue
        while visited[by_freq[nxt_hot]]:
            nxt_hot += 1
        cur = int(by_freq[nxt_hot])
    return order


def positions_of(order: np.ndarray) -> np.ndarray:
    """The inverse permutation: ``positions_of(order)[neuron]`` is the neuron's row in the file."""
    pos = np.empty(len(order), dtype=np.int32)
    pos[np.asarray(order)] = np.arange(len(order), dtype=np.int32)
    return pos


def reads_per_token(masks: np.ndarray, positions: np.ndarray | None, skip: int = 0,
                    gap: int = 0) -> float:
    """Mean number of reads per token for the active neurons ``>= skip`` (the ones not in RAM)
    of ``masks`` ``[T, F]``, bundles at ``positions`` (``None``: neuron order): runs of file
    rows, a read passing over up to ``gap`` unwanted rows (``NeuronReader``'s ``max_gap``; its
    cap of ``MAX_RUN`` rows per read is not counted here)."""
    m = np.asarray(masks, dtype=bool)
    T, F = m.shape
    cold = m.copy()
    cold[:, :skip] = False
    if positions is not None:
        placed = np.zeros_like(cold)
        placed[:, np.asarray(positions)] = cold
        cold = placed
    # a read starts at an active row with no active row among the gap + 1 rows before it
    before = np.zeros_like(cold)
    for k in range(1, gap + 2):
        before[:, k:] |= cold[:, :-k]
    return float((cold & ~before).sum()) / max(T, 1)


def profile_orders(profile, max_tokens: int = MAX_TOKENS, cold_share: float = 0.8,
                   progress=None) -> list[np.ndarray]:
    """Per layer, the co-activation order of a converted file's neurons (which the exporter
    wrote hot-first, ``offline.export.hot_first_permutations``) from ``profile``'s masks
    (``offline.profile.Profile``). Logs the reads per token the order saves on the profiled
    tokens for the coldest ``cold_share`` of the neurons. ``progress(1)`` is called after each
    layer (``offline.pipeline.Bars``)."""
    from ..offline.export import hot_first_permutations

    perms = hot_first_permutations(profile.freqs)
    T, F = profile.n_tokens, profile.d_ff
    sel = np.linspace(0, T - 1, min(T, max_tokens)).round().astype(np.int64)
    skip = int(round(F * (1.0 - cold_share)))
    orders, before, after, after_gap = [], 0.0, 0.0, 0.0
    for layer, perm in enumerate(perms):
        packed = np.asarray(profile.packed_masks(layer)[sel])
        masks = np.unpackbits(packed, axis=-1, count=F, bitorder="little").astype(bool)[:, perm]
        order = coactivation_order(masks, max_tokens)
        orders.append(order)
        before += reads_per_token(masks, None, skip)
        after += reads_per_token(masks, positions_of(order), skip)
        after_gap += reads_per_token(masks, positions_of(order), skip, gap=2)
        if progress is not None:
            progress(1)
    L = max(len(perms), 1)
    log.info("co-activation order: %.0f -> %.0f reads per token and layer (%.0f passing over up to "
             "2 unwanted rows) for the coldest %.0f%% of the neurons, on %d profiled tokens",
             before / L, after / L, after_gap / L, 100 * cold_share, sel.size)
    return orders
