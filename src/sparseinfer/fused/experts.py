"""One token through a mixture of experts on the C kernels (``models.model.MoE``'s decode step).

``MoE.forward`` loops over the experts the rows picked, each a dense FFN of ``GGMLLinear``
products: for one token that is three C calls, a few torch operations and the pool's wake-up per
picked expert. Here the picked experts' gate and up rows go to the pool in one GEMV call (the
input quantized once), their activations are computed together, and each expert's down product
takes its router weight folded into its input. ``MoE.forward``'s loop is the reference
(``tests/models/test_moe.py`` compares them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import cpu
from ..quant.linear import GGMLLinear

# matrices one GEMV call takes (cpu.GemvPlan)
MAX_MATS = 16


class ExpertsDecode:
    """The decode step of a ``MoE`` whose experts are all ``GGMLLinear`` without biases: build
    with ``ExpertsDecode.of(moe)`` (None when it cannot take the module), call with the token's
    FFN input (d_model,)."""

    def __init__(self, moe) -> None:
        first = moe.experts[0]
        self.route, self.k = moe.route, moe.k
        self.act_gate, self.act_up = first.act_gate, first.act_up
        self.ins = [e.w_in.mats for e in moe.experts]  # each expert's gate and up matrices
        self.downs = [e.down.mats for e in moe.experts]
        F, D = first.d_ff, first.down.out_features
        self.gate_up = torch.empty(self.k, 2, F)
        self.outs = [self.gate_up[j, s] for j in range(self.k) for s in range(2)]
        self.y = torch.empty(self.k, D)
        self.y_rows = list(self.y)

    @classmethod
    def of(cls, moe) -> ExpertsDecode | None:
        """The fast step for ``moe``, or None: an expert that is not a gated FFN of the C
        kernels' matrices (the plan's "ggml" storage), with one matrix for each of gate, up and
        down, and no biases."""
        for e in moe.experts:
            if not (e.gated and isinstance(e.w_in, GGMLLinear) and isinstance(e.down, GGMLLinear)
                    and len(e.w_in.mats) == 2 and len(e.down.mats) == 1
                    and e.w_in.bias is None and e.down.bias is None):
                return None
        return cls(moe)

    def __call__(self, x: Tensor) -> Tensor:
        """x (d_model,) float32 contiguous -> the layer's FFN output (d_model,)."""
        weights, chosen = self.route(x.view(1, -1))
        picked = chosen[0].tolist()
        mats = [m for e in picked for m in self.ins[e]]
        for s in range(0, len(mats), MAX_MATS):
            cpu.gemv(mats[s:s + MAX_MATS], x, self.outs[s:s + MAX_MATS])
        h = self.act_gate(self.gate_up[:, 0]) * self.act_up(self.gate_up[:, 1])
        h.mul_(weights[0].view(-1, 1))  # down(w h) = w down(h)
        for j, e in enumerate(picked):
            cpu.gemv(self.downs[e], h[j], self.y_rows[j:j + 1])
        return self.y.sum(0)
