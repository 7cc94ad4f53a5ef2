"""A mixture of experts on the C kernels (``models.model.MoE`` when its experts are the C
kernels' matrices).

``MoE.forward`` loops over the experts the rows picked, each a dense FFN of ``GGMLLinear``
products: three C calls, a few torch operations and a pool wake-up per picked expert — for one
token 8 experts' worth, for a prompt nearly every expert's. Here the rows are grouped by expert
and each projection of all the picked experts goes to the pool in one call of up to 16
matrices, each against its own rows (one token: ``cpu.GemvPlan``s, its gate and up rows sharing
its input, its down rows each their own; several rows: ``cpu.gemm_each``); the activations are
computed together and each row's router weight is folded into its down product's input.
``MoE.loop`` is the reference (``tests/models/test_moe.py`` compares them).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .. import cpu
from ..quant.linear import GGMLLinear

# matrices one call of the C library takes (cpu.GemvPlan, cpu.gemm_each)
MAX_MATS = 16


def _groups(items):
    """``items`` in runs of at most MAX_MATS (a list, or a tensor's rows)."""
    return [items[s:s + MAX_MATS] for s in range(0, len(items), MAX_MATS)]


class CExperts:
    """The experts of a ``MoE`` that are all ``GGMLLinear`` gated FFNs without biases: build
    with ``CExperts.of(moe)`` (None when it cannot take the module); ``one(x)`` for a token's
    FFN input (d_model,), ``rows(x)`` for several (n, d_model)."""

    def __init__(self, moe) -> None:
        first = moe.experts[0]
        self.route, self.k = moe.route, moe.k
        self.router, self.renorm = moe.router, moe.renorm
        self.act_gate, self.act_up = first.act_gate, first.act_up
        self.gates = [e.w_in.mats[0] for e in moe.experts]
        self.ups = [e.w_in.mats[1] for e in moe.experts]
        self.downs = [e.down.mats[0] for e in moe.experts]
        self.d_ff, self.d_model = first.d_ff, first.down.out_features
        # one token: the picked experts' gate and up rows, their down products, into fixed
        # buffers by plans whose matrices change token by token (cpu.GemvPlan.set_mats)
        self.gate_up = torch.empty(self.k, 2, self.d_ff)
        outs = [self.gate_up[j, s] for j in range(self.k) for s in range(2)]
        self.y = torch.empty(self.k, self.d_model)
        y_rows = list(self.y)
        pairs = [m for _ in range(self.k) for m in (self.gates[0], self.ups[0])]  # (any, to
        # start with: the picked experts' are set before each call)
        self.in_plans = [cpu.GemvPlan(ms, os) for ms, os in zip(_groups(pairs), _groups(outs))]
        self.down_plans = [cpu.GemvPlan(ms, os, each=True)
                           for ms, os in zip(_groups([self.downs[0]] * self.k), _groups(y_rows))]

    @classmethod
    def of(cls, moe) -> CExperts | None:
        """The C path for ``moe``, or None: an expert that is not a gated FFN of the C kernels'
        matrices (the plan's "ggml" storage) with one matrix for each of gate, up and down and
        no biases."""
        for e in moe.experts:
            if not (e.gated and isinstance(e.w_in, GGMLLinear) and isinstance(e.down, GGMLLinear)
                    and len(e.w_in.mats) == 2 and len(e.down.mats) == 1
                    and e.w_in.bias is None and e.down.bias is None):
                return None
        return cls(moe)

    def one(self, x: Tensor) -> Tensor:
        """x (d_model,) float32 contiguous -> the layer's FFN output (d_model,)."""
        weights, picked = self.route_one(x)
        mats = [m for e in picked for m in (self.gates[e], self.ups[e])]
        for plan, ms in zip(self.in_plans, _groups(mats)):  # they share x: quantized once
            plan.set_mats(ms)
            plan(x)
        h = self.act_gate(self.gate_up[:, 0]) * self.act_up(self.gate_up[:, 1])
        h.mul_(weights.view(-1, 1))  # down(w h) = w down(h)
        for plan, ms, hs in zip(self.down_plans, _groups([self.downs[e] for e in picked]),
                                _groups(h)):  # each against its own input
            plan.set_mats(ms)
            plan(hs)
        return self.y.sum(0)

    def route_one(self, x: Tensor) -> tuple[Tensor, list[int]]:
        """``MoE.route`` of one row in numpy (torch's operations on 128 numbers cost more than
        the arithmetic): the router's softmax weights of the k best experts (renormalized as the
        module does) and the experts, best first."""
        logits = self.router(x.view(1, -1)).reshape(-1).numpy()
        best = np.argpartition(-logits, self.k - 1)[:self.k]
        best = best[np.argsort(-logits[best], kind="stable")]
        e = np.exp(logits - logits.max())
        w = e[best] / (e[best].sum() if self.renorm else e.sum())
        return torch.from_numpy(w.astype(np.float32)), best.tolist()

    def rows(self, x: Tensor) -> Tensor:
        """x (n, d_model) float32 contiguous -> the FFN outputs (n, d_model): each expert's
        products over the rows that picked it, up to 16 experts a call."""
        weights, chosen = self.route(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, pick) pairs grouped by expert
        token = order // self.k
        counts = torch.bincount(flat, minlength=len(self.downs))
        used = counts.nonzero().reshape(-1).tolist()
        n_rows = counts[used].tolist()
        xs = x[token].contiguous()
        gate, up = torch.empty(len(order), self.d_ff), torch.empty(len(order), self.d_ff)
        self._each(self.gates, used, n_rows, xs, gate)
        self._each(self.ups, used, n_rows, xs, up)
        h = self.act_gate(gate).mul_(self.act_up(up))
        h.mul_(weights.reshape(-1)[order].view(-1, 1))  # down(w h) = w down(h)
        y = torch.empty(len(order), self.d_model)
        self._each(self.downs, used, n_rows, h, y)
        return torch.zeros(x.shape[0], self.d_model).index_add_(0, token, y)

    @staticmethod
    def _each(mats, used: list[int], n_rows: list[int], x: Tensor, out: Tensor) -> None:
        """out's rows = x's rows through mats[used[i]], n_rows[i] rows each, in order."""
        at = 0
        for s in range(0, len(used), MAX_MATS):
            counts = n_rows[s:s + MAX_MATS]
            outs, off = [], at
            for c in counts:
                outs.append(out[off:off + c])
                off += c
            cpu.gemm_each([mats[e] for e in used[s:s + MAX_MATS]], x[at:off], counts, outs)
            at = off
