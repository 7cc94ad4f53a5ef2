"""The sparse FFN module that replaces a dense ``FFN`` in the transformer.

Per decoded token: the predictor (or, in oracle mode, the true activations) gives the active set;
only those neurons' bundled rows are read. Neurons are stored hot-first, so the fast tier holds
neurons ``[0, n_hot)`` and the slow tier (always the CPU) ``[n_hot, d_ff)``; each tier computes its
own active neurons and the results merge on the fast device. Several tokens at once (a prompt,
a batched step) run each token's own set over the bundles of their union (the C kernels' or
numba's), or the dense product on the same bundled rows (``batch_mode``, ``UNION_MAX_TOKENS``) —
or, where the plan holds a dense copy of the FFN beside the bundles (``DenseCopy``: predictors
that select most neurons), the dense product of that copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ..config import FFN_KINDS
from ..cpu import loads as cpu_loads
from .packed import PackedFFN
from .reference import ACTS, neuron_coefs, sparse_ffn_ref

log = logging.getLogger(__name__)


def _kernels():
    """``sparse.kernels`` (numba): imported when a sparse FFN first runs, not when a model module
    is imported (start-up time of dense models)."""
    from . import kernels

    return kernels


@dataclass
class Predictor:
    """``logits = fc2 @ relu(fc1 @ x) (+ bias)``; neuron i is predicted active iff logit >= threshold."""

    fc1: Tensor  # [r, d_model] fp32 or bf16
    fc2: Tensor  # [d_ff, r] fp32 or bf16
    threshold: float = 0.0
    bias: Tensor | None = None  # [d_ff]

    @property
    def n_params(self) -> int:
        return self.fc1.numel() + self.fc2.numel() + (0 if self.bias is None else self.bias.numel())

    def logits(self, x: Tensor) -> Tensor:
        z = self.fc2.float() @ torch.relu(self.fc1.float() @ x)
        return z if self.bias is None else z + self.bias


@dataclass(frozen=True)
class DenseCopy:
    """A sparse FFN as dense matrices, held beside its neuron bundles (``SparsePlan.batch_dense``)
    for several rows at once — a batched step, a prompt — where a batch's union is nearly every
    neuron and the dense product (a dense model's layer) is the faster way to it: ``w_in``
    (``quant.linear.GGMLLinear``: gate rows then up rows, or up rows; its bias 0 for the gate
    rows, then the up bias) and ``down`` (``GGMLLinear`` [d_model, d_ff], no bias: the down bias
    stays the FFN's)."""

    w_in: nn.Module  # quant.linear.GGMLLinear
    down: nn.Module  # quant.linear.GGMLLinear

    def __call__(self, x: Tensor, kind) -> Tensor:
        """Every neuron's output summed, for rows ``x`` float32 [N, d_model]: [N, d_model]."""
        z = self.w_in(x)
        if kind.gated:
            g, u = z.chunk(2, dim=1)
            h = ACTS[kind.gate_act](g) * ACTS[kind.up_act](u)
        else:
            h = ACTS[kind.up_act](z)
        return self.down(h)


class FFNStats:
    """Tokens and neurons computed (summed over tokens), in an int64 array [2] that a fused
    stack's C block adds to as well (``cpu.SparseBlockFFN.counts``)."""

    def __init__(self):
        self.counts = np.zeros(2, dtype=np.int64)

    @property
    def tokens(self) -> int:
        return int(self.counts[0])

    @tokens.setter
    def tokens(self, n: int) -> None:
        self.counts[0] = n

    @property
    def active(self) -> int:
        return int(self.counts[1])

    @active.setter
    def active(self, n: int) -> None:
        self.counts[1] = n

    def density(self, d_ff: int) -> float:
        return self.active / max(self.tokens * d_ff, 1)


BATCH_MODES = ("auto", "dense", "union", "masked")
# each mode as a fused C block takes it (cpu/qgemv.h, si_sparse_ffn.mode): "auto" and "masked"
# each row its own set (as here), "union", and "dense"
# every neuron (by the sparse kernel over the bundles: here torch's product of the same rows,
# the same sums rounded otherwise)
C_BATCH_MODES = {"auto": 0, "masked": 0, "union": 1, "dense": 2}
C_COPY_MODE = 3  # "auto" and "dense" with a dense copy: every neuron by the copy's matrices
# "auto" prefill of rows the C kernels do not take (fp32, bf16): the batched kernel over the
# union's bundles ("the union kernel" below) up to this many tokens, dense above. Measured with
# benchmarks/prefill.py (benchmarks/RESULTS.md): on a 7B-shaped ReLU-like FFN the union kernel
# beats torch's dense FFN 38x at 1 token, 5.7x at 8, 2.6x at 16 and 1.07x at 64 (union density
# 97%); on SmolLM2 (union density 100%) 1.2-1.6x up to 64 tokens, 0.96x at 256 with fp32 rows.
# With bf16/int8 rows the dense path must dequantize every row first: there the union kernel
# wins at every length measured (int8 SmolLM2: 3-5x up to 64 tokens, 1.21x at 256), so "auto"
# takes it whatever the length.
UNION_MAX_TOKENS = 32


class Selector:
    """Which neurons a token computes: a small strategy object chosen when the model is built
    (``AllNeurons``, ``Oracle``, ``Predicted``)."""

    name = "?"

    def active(self, ffn: SparseFFN, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """Ascending int32 indices for one token's 1-D FFN input ``x`` (``residual``: the
        residual stream before the FFN's norm, for selectors that predict from it)."""
        raise NotImplementedError

    def mask(self, ffn: SparseFFN, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """Boolean (..., d_ff): each token's active neurons, for inputs ``x`` (..., d_model)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AllNeurons(Selector):
    """Every neuron: the dense FFN computed by the sparse kernels."""

    name = "all"

    def active(self, ffn, x, residual=None):
        return ffn._all

    def mask(self, ffn, x, residual=None):
        return torch.ones(*x.shape[:-1], ffn.d_ff, dtype=torch.bool, device=x.device)


class Oracle(Selector):
    """The true active set: non-zero coefficients (ReLU family), or a magnitude score above the
    calibrated threshold: |h_i| ("output"), |h_i|·||down_i|| ("output_norm"), or the gate's
    activation |act(gate_i · x)| ("gate")."""

    name = "oracle"

    def __init__(self, threshold: float = 0.0, score: str = "output"):
        if score not in ("output", "output_norm", "gate"):
            raise ValueError(f"oracle score: expected 'output', 'output_norm' or 'gate', got "
                             f"{score!r}")
        self.threshold, self.score = float(threshold), score

    def __repr__(self) -> str:
        return f"Oracle(threshold={self.threshold:g}, score={self.score!r})"

    def mask(self, ffn, x, residual=None):
        h = ffn._coefs_dense(x)
        if ffn.kind.relu_sparse:
            return h != 0
        if self.score == "output_norm":
            return h.abs() * ffn._down_norms() > self.threshold
        if self.score == "gate" and ffn.kind.gated:
            return ffn._gate_acts(x).abs() > self.threshold
        return h.abs() > self.threshold

    def active(self, ffn, x, residual=None):
        return torch.nonzero(self.mask(ffn, x)).reshape(-1).to(torch.int32)


class Predicted(Selector):
    """The predictor's guess: neuron i is computed iff its logit passes the threshold (a bias
    folds into per-neuron thresholds: fc2·h + b >= t  <=>  fc2·h >= t - b). ``on_residual``:
    the predictor reads the residual stream before the FFN's norm (PowerInfer's files: its
    runtime feeds the predictor ``ffn_inp``), else the FFN's own input."""

    name = "predictor"

    def __init__(self, predictor: Predictor | None = None, on_residual: bool = False,
                 threshold: float = 0.0):
        self.on_residual = on_residual
        self.threshold = threshold  # until ``fill`` brings the predictor's weights
        self.predictor: Predictor | None = None
        if predictor is not None:
            self.fill(predictor)

    def fill(self, predictor: Predictor) -> None:
        """Take the predictor's weights (built empty with the model, filled from the file)."""
        self.predictor = predictor
        self.threshold = predictor.threshold
        self._neuron_thr = (None if predictor.bias is None else
                            (predictor.threshold - predictor.bias).float().contiguous())
        self._c = None  # float16 weights: the C library's kernel, on the FFN rows' thread pool
        # float16 weights without the C library: float32 copies for numba's kernel
        self._fc = (predictor.fc1, predictor.fc2)
        if predictor.fc1.dtype == torch.float16 and predictor.fc1.device.type == "cpu":
            if cpu_loads():
                from .. import cpu

                thr = (self._neuron_thr if self._neuron_thr is not None else
                       torch.full((predictor.fc2.shape[0],), float(predictor.threshold)))
                self._c = cpu.F16Predictor(predictor.fc1, predictor.fc2, thr)
            else:
                self._fc = (predictor.fc1.float(), predictor.fc2.float())

    def __repr__(self) -> str:
        p = self.predictor
        if p is None:
            return f"Predicted(empty, threshold={self.threshold:g})"
        return (f"Predicted(rank={p.fc1.shape[0]}, {str(p.fc1.dtype).replace('torch.', '')}, "
                f"threshold={p.threshold:g}{', on the residual' if self.on_residual else ''})")

    def active(self, ffn, x, residual=None):
        p = self.predictor
        if self.on_residual:
            x = residual.reshape(-1).float().contiguous()
        if self._c is not None and x.device.type == "cpu":
            from ..cpu import predict_f16

            return ffn._idx[:predict_f16(self._c, x, ffn._idx)]
        if x.device.type == "cpu":
            k = _kernels().predict_active(x, *self._fc, p.threshold, ffn._idx,
                                       neuron_thresholds=self._neuron_thr)
            return ffn._idx[:k]
        return torch.nonzero(p.logits(x) >= p.threshold).reshape(-1).to(torch.int32)

    def mask(self, ffn, x, residual=None):
        p = self.predictor
        if self.on_residual:
            x = residual.reshape(x.shape).float()
        if self._c is not None and x.device.type == "cpu":
            # the C library's pool, as ``active`` (each token the set it gets alone; torch's
            # small matmuls would wake its own thread team every layer)
            from ..cpu import predict_f16_mask

            return predict_f16_mask(self._c, x.reshape(-1, x.shape[-1]).contiguous()).reshape(
                *x.shape[:-1], -1)
        z = torch.relu(x @ p.fc1.float().t()) @ p.fc2.float().t()
        if p.bias is not None:
            z = z + p.bias
        return z >= p.threshold


class SparseFFN(nn.Module):
    """An FFN layer computed neuron by neuron (same forward signature as ``models.model.FFN``).
    Built empty with its selector; ``fill`` takes the bundled rows once."""

    def __init__(self, kind: str, d_model: int, d_ff: int, selector: Selector, n_hot: int = 0,
                 fast_device: str | torch.device = "cpu", split_tiers: bool | None = None):
        super().__init__()
        self.kind_name, self.kind = kind, FFN_KINDS[kind]
        self.d_ff, self.d_model = d_ff, d_model
        self.selector = selector
        self.fast = torch.device(fast_device)
        self.n_hot = int(n_hot)
        # one tier when everything lives on the CPU (unless a test asks for the split path)
        split = (self.fast.type != "cpu") if split_tiers is None else split_tiers
        self.split = split and 0 < self.n_hot
        self.hot = self.cold = self.packed = None
        self.down_bias = None
        self.stats = FFNStats()
        # several tokens at once: "dense" computes every neuron (prefill); "union" the union of
        # the tokens' active sets with the batched sparse kernel; "masked" each token's own
        # active set (what decode computes); "auto" as "masked", but every neuron for long
        # batches of fp32 rows (``forward``)
        self._mode_cell = np.zeros(1, dtype=np.int32)  # the mode as a fused C block reads it
        self.dense_copy: DenseCopy | None = None  # "auto" and "dense" batches take it (``fill``)
        self.batch_mode = "auto"

    @property
    def batch_mode(self) -> str:
        return self._batch_mode

    @batch_mode.setter
    def batch_mode(self, mode: str) -> None:
        if mode not in BATCH_MODES:
            raise ValueError(f"batch mode: expected one of {list(BATCH_MODES)}, got {mode!r}")
        self._batch_mode = mode
        self._mode_cell[0] = C_COPY_MODE if self._from_copy(mode) else C_BATCH_MODES[mode]

    def _from_copy(self, mode: str) -> bool:
        """Whether several rows in batch mode ``mode`` take the dense copy."""
        return self.dense_copy is not None and mode in ("auto", "dense")

    @property
    def mode(self) -> str:
        return self.selector.name

    @property
    def predictor(self) -> Predictor | None:
        return getattr(self.selector, "predictor", None)

    def extra_repr(self) -> str:
        dtype = (self.packed or self.cold).dtype if (self.packed or self.cold) else "?"
        return (f"{self.kind_name}, d_ff={self.d_ff}, rows={dtype}, selector={self.selector!r}, "
                f"hot={self.n_hot} on {self.fast}")

    def fill(self, packed: PackedFFN, down_bias: Tensor | None = None,
             dense_copy: DenseCopy | None = None) -> None:
        if (packed.d_ff, packed.d_model) != (self.d_ff, self.d_model):
            raise ValueError(f"expected a packed FFN of d_ff={self.d_ff}, d_model={self.d_model}, "
                             f"got {packed.d_ff}, {packed.d_model}")
        if self.split:
            self.hot = packed_to_device(packed.select(torch.arange(self.n_hot)), self.fast)
            self.cold = packed.select(torch.arange(self.n_hot, self.d_ff))
            self.packed = None
        else:
            self.hot, self.cold, self.packed = None, packed, packed
        self.down_bias = down_bias
        if dense_copy is not None and self.split:
            raise ValueError("dense_copy: expected one tier (a dense copy is for CPU batches)")
        self.dense_copy = dense_copy
        self.batch_mode = self._batch_mode  # its C code: C_COPY_MODE with a dense copy
        self._idx = torch.empty(self.d_ff, dtype=torch.int32)
        self._all = torch.arange(self.d_ff, dtype=torch.int32)
        self._out = torch.empty(self.d_model, dtype=torch.float32)
        self._out_cold = torch.empty(self.d_model, dtype=torch.float32)
        self._norms = None

    @classmethod
    def from_packed(cls, packed: PackedFFN, down_bias: Tensor | None, selector: Selector,
                    **kw) -> SparseFFN:
        m = cls(packed.kind, packed.d_model, packed.d_ff, selector, **kw)
        m.fill(packed, down_bias)
        return m

    def c_block_ffn(self):
        """This FFN as a fused C block computes it (``cpu.SparseBlockFFN``: the same calls as
        ``forward``'s, inside the block), or None where that block does not take it: two tiers,
        rows the C kernels do not take (``kernels.in_c``), a selector other than a float16
        predictor or every neuron."""
        p = self.packed
        if self.split or p is None or p.rows.device.type != "cpu" or not _kernels().in_c(p):
            return None
        sel = self.selector
        if isinstance(sel, AllNeurons):
            predictor, on_residual = None, False
        elif isinstance(sel, Predicted) and sel._c is not None:
            predictor, on_residual = sel._c, sel.on_residual
        else:
            return None
        from .. import cpu

        int8 = p.dtype in ("int8", "q4i8")  # (q4i8: the scales in the bundles, p.scales None)
        c = self.dense_copy
        return cpu.SparseBlockFFN(
            rows=p.rows, scales=p.scales if int8 else None, block=p.block if int8 else 0,
            round_x=_kernels().rounds_x(p), up_bias=p.up_bias, predictor=predictor,
            on_residual=on_residual, mode=self._mode_cell, counts=self.stats.counts,
            gates=p.gates, w_in=tuple(c.w_in.mats) if c else (),
            down=tuple(c.down.mats) if c else (), w_in_bias=c.w_in.bias if c else None)

    # ---- active set ----------------------------------------------------------------------------

    def active(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """Ascending int32 indices of the neurons to compute for the 1-D input ``x``."""
        return self.selector.active(self, x, residual)

    def _down_norms(self) -> Tensor:
        if self._norms is None:
            self._norms = torch.cat([f.rows_fp32()[:, -1].norm(dim=-1) for f, _ in self._rows()
                                     if f.d_ff])
        return self._norms

    def _gate_acts(self, x: Tensor) -> Tensor:
        parts = [ACTS[self.kind.gate_act](x.to(f.rows.device) @ f.rows_fp32()[:, 0].t())
                 .to(x.device) for f, _ in self._rows() if f.d_ff]
        return torch.cat(parts, dim=-1)

    def _rows(self) -> list[tuple[PackedFFN, int]]:
        return [(self.hot, 0), (self.cold, self.n_hot)] if self.split else [(self.packed, 0)]

    def _coefs_dense(self, x: Tensor) -> Tensor:
        """True coefficients h of every neuron for input(s) x (..., d_model)."""
        parts = []
        for ffn, _ in self._rows():
            if ffn.d_ff:
                xx = x.to(ffn.rows.device)
                parts.append(neuron_coefs(xx, ffn, ffn.rows_fp32(), ffn.up_bias).to(x.device))
        return torch.cat(parts, dim=-1)

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        if B * T > 1:
            if self._from_copy(self.batch_mode) and x.device.type == "cpu":
                out = self.dense_copy(x.float().reshape(B * T, D).contiguous(), self.kind)
                if self.down_bias is not None:
                    out += self.down_bias
                return out.to(x.dtype).reshape(B, T, D)
            one_tier = not self.split and x.device.type == "cpu"
            # over the bundles of the union of the tokens' sets, each read once per pass of
            # tokens: "union" every token the union, "masked" and "auto" each token its own set
            # (the rows of a continuous-batching step and prompts alike) — "auto" at any length
            # where the C kernels take the rows (faster than the union at every length measured:
            # benchmarks/RESULTS.md), on numba's kernel up to UNION_MAX_TOKENS tokens of fp32
            # rows, then torch's dense product of every neuron (cold: the CPU rows)
            if one_tier and self.batch_mode != "dense" and (
                    self.batch_mode != "auto" or _kernels().in_c(self.packed)
                    or B * T <= UNION_MAX_TOKENS or self.cold.dtype != "fp32"):
                return self._union(x, residual, own=self.batch_mode != "union")
            return self._dense(x, residual)  # ("masked" on two tiers: torch's product, masked)
        xv = x.reshape(D).float()
        idx = self.active(xv, residual)
        self.stats.tokens += 1
        self.stats.active += int(idx.numel())
        out = self._sparse(xv, idx)
        if self.down_bias is not None:
            out = out + self.down_bias
        return out.to(x.dtype).reshape(B, T, D)

    def _sparse(self, x: Tensor, idx: Tensor) -> Tensor:
        if not self.split:
            if x.device.type == "cpu":
                return _kernels().sparse_ffn(x, self.packed, idx, self._out)
            return sparse_ffn_ref(x, self.packed, idx, torch.empty_like(x))
        # indices are ascending: [0, n_hot) belong to the fast tier, the rest to the CPU tier
        cut = int(torch.searchsorted(idx, torch.tensor(self.n_hot, dtype=idx.dtype)))
        hot_idx, cold_idx = idx[:cut], idx[cut:] - self.n_hot
        x_fast = x.to(self.fast, non_blocking=True)
        # launch the fast tier first: on CUDA it runs asynchronously while the CPU works
        out = sparse_ffn_ref(x_fast, self.hot, hot_idx.to(self.fast, non_blocking=True),
                             torch.empty(self.d_model, device=self.fast))
        x_cpu = x.cpu()
        cold = _kernels().sparse_ffn(x_cpu, self.cold, cold_idx.cpu(), self._out_cold)
        return out + cold.to(self.fast, non_blocking=True)

    def _union(self, x: Tensor, residual: Tensor | None = None, own: bool = False) -> Tensor:
        """A batch of tokens over the union of their active sets (one read of each active
        neuron's bundle for all tokens: ``kernels.sparse_ffn_batch``); ``own``: each token
        computes only its own set within the union: the neurons it would take alone."""
        B, T, D = x.shape
        xf = x.float().reshape(B * T, D).contiguous()
        rows = None
        if isinstance(self.selector, AllNeurons):
            idx = self._all
        else:
            r = None if residual is None else residual.float().reshape(B * T, D)
            rows = self.selector.mask(self, xf, r)  # [B*T, d_ff]
            taken = rows.any(dim=0)
            # (a union of every neuron, as a few tokens of a dense-ish FFN take: no gather)
            idx = self._all if taken.all() else torch.nonzero(taken).reshape(-1).to(torch.int32)
        own = own and rows is not None
        mask = None if not own else rows if idx is self._all else rows[:, idx.long()].contiguous()
        self.stats.tokens += B * T
        self.stats.active += int(mask.sum()) if own else int(idx.numel()) * B * T
        out = torch.empty(B * T, D, dtype=torch.float32)
        if idx.numel():
            _kernels().sparse_ffn_batch(xf, self.packed, idx, out, mask)
        else:
            out.zero_()
        if self.down_bias is not None:
            out += self.down_bias
        return out.to(x.dtype).reshape(B, T, D)

    def _dense(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """A batch of tokens (prefill) from the bundled rows: all neurons, or with
        ``batch_mode == "masked"`` only each token's own active set."""
        xf = x.float()
        mask = None
        if self.batch_mode == "masked":
            mask = self.selector.mask(self, xf, None if residual is None else residual.float())
            self.stats.tokens += mask[..., 0].numel()
            self.stats.active += int(mask.sum())
        out = None
        for ffn, start in self._rows():
            if not ffn.d_ff:
                continue
            rows = ffn.rows_fp32()  # fp32: a view, no copy
            xx = xf.to(rows.device)
            h = neuron_coefs(xx, ffn, rows, ffn.up_bias)
            if mask is not None:
                h = h * mask[..., start:start + ffn.d_ff].to(h.device)
            part = (h @ rows[:, -1]).to(x.device)
            out = part if out is None else out + part
        if self.down_bias is not None:
            out = out + self.down_bias
        return out.to(x.dtype)


def packed_to_device(p: PackedFFN, device: torch.device) -> PackedFFN:
    """``p``'s tensors on ``device`` (a fast tier's rows)."""
    from dataclasses import replace

    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return replace(p, rows=mv(p.rows), scales=mv(p.scales), up_bias=mv(p.up_bias),
                   gates=mv(p.gates))
