"""Quantized projections for the dense parts: 4-bit blocks (attention, dense FFN) and an int8
LM head, each a drop-in for a bias-free or biased ``nn.Linear`` on the CPU.

4-bit: torch's own CPU kernel for weight-only quantization, ``torch._weight_int4pack_mm_for_cpu``
(groups of 32, per-group scale and zero, so a Q4_0/Q4_1 block maps onto it exactly: ``(q − 8) ·
scale + zero`` with ``zero = offset + 8 · scale``; the scales are rounded to bfloat16). It takes
bfloat16 activations (llama.cpp rounds them to 8 bits for its quantized dot products); results
come back as float32. int8: one token through ``gemv_int8`` (numba, fp32 activations, ≈2× torch's
int8 kernel on this machine: the head is the largest single matrix), batches through
``torch._weight_int8pack_mm`` (bfloat16 activations). The reference for each is ``F.linear`` on
the dequantized weights (``reference``, ``gemv_int8_ref``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..cpu import loads as cpu_loads
from ..errors import SparseInferError
from .blocks import GROUP, Q4Blocks

ACT_DTYPE = torch.bfloat16


def _need_cpu_op(name: str) -> None:
    if not hasattr(torch, name):
        raise SparseInferError(f"4-bit/8-bit weights need torch.{name} (torch >= 2.5), found "
                               f"torch {torch.__version__}")


class Int4Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` held as 4-bit blocks (CPU). Built empty (on the meta
    device); ``fill`` takes the blocks once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        _need_cpu_op("_weight_int4pack_mm_for_cpu")
        self.in_features, self.out_features = in_features, out_features
        self.packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        # (k / 32, n, 2): per group and output row, (scale, zero)
        self.scales_zeros = torch.empty(in_features // GROUP, out_features, 2, dtype=ACT_DTYPE)
        self.bias = torch.empty(out_features) if bias else None

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks, bias: torch.Tensor | None = None) -> Int4Linear:
        n, k = blocks.shape
        with torch.device("cpu"):
            m = cls(k, n, bias is not None)
        m.fill(blocks, bias)
        return m

    def fill(self, blocks: Q4Blocks, bias: torch.Tensor | None = None) -> None:
        if blocks.shape != (self.out_features, self.in_features):
            raise ValueError(f"expected blocks of shape {(self.out_features, self.in_features)}, "
                             f"got {blocks.shape}")
        from . import int4pack  # (numba: imported where it is first needed)

        self.packed = int4pack.pack(blocks.q)
        zero = blocks.offset + 8.0 * blocks.scale
        self.scales_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1).to(ACT_DTYPE)
        self.scales_zeros = self.scales_zeros.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, 4-bit groups of {GROUP}"

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weights this module multiplies by, as float32 (bfloat16-rounded scales)."""
        eye = torch.eye(self.in_features, dtype=ACT_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP,
                                                 self.scales_zeros).float().t().contiguous()


def gemv_int8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """``out = (q · scale[:, None]) @ x`` for int8 ``q`` [n, k] (contiguous), float32 ``scale``
    [n], ``x`` [k] and ``out`` [n]: fp32 activations, one streaming pass split over the kernel
    threads (reference: ``gemv_int8_ref``)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"q: expected contiguous int8 [n, k], got {q.dtype} {list(q.shape)}")
    n, k = q.shape
    for name, t, shape in (("scale", scale, (n,)), ("x", x, (k,)), ("out", out, (n,))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous float32 {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    from ..sparse.kernels import use_threads
    from .int8_kernels import int8_gemv_kernel  # numba: imported on first use

    int8_gemv_kernel(q.numpy(), scale.numpy(), x.numpy(), use_threads() * 4, out.numpy())
    return out


def gemm_int8_rows(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(q · scale[:, None]) @ x.T`` -> [B, n] for a few fp32 rows ``x`` [B, k]: ``gemv_int8``'s
    arithmetic for every row (each output computed the same way whatever B is), with each weight
    row streamed from memory once for all B rows (reference: ``gemv_int8_ref`` per row)."""
    if x.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"x: expected [B, {q.shape[1]}], got {list(x.shape)}")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], q.shape[0])
    from ..sparse.kernels import use_threads
    from .int8_kernels import int8_gemm_kernel

    int8_gemm_kernel(q.numpy(), scale.numpy(), x.numpy(), use_threads() * 4, out.numpy())
    return out


def gemv_int8_ref(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale[:, None]) @ x


class Int8Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` quantized per row, symmetric absmax int8 (CPU). One token
    goes through ``gemv_int8`` (fp32 activations), batches through torch's int8 kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        _need_cpu_op("_weight_int8pack_mm")
        self.in_features, self.out_features = in_features, out_features
        self.q = torch.empty(out_features, in_features, dtype=torch.int8)
        self.scale32 = torch.empty(out_features)
        self.scale = torch.empty(out_features, dtype=ACT_DTYPE)
        self.bias = torch.empty(out_features) if bias else None
        self._out = torch.empty(out_features)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        with torch.device("cpu"):
            m = cls(weight.shape[1], weight.shape[0], bias is not None)
        m.fill(lambda a, b: weight[a:b], bias)
        return m

    def fill(self, rows, bias: torch.Tensor | None = None, chunk: int = 4096) -> None:
        """Quantize from ``rows(start, stop)`` (float rows of W), ``chunk`` rows at a time so
        no whole float copy of a large matrix (an LM head) exists."""
        n, k = self.out_features, self.in_features
        self.q = torch.empty(n, k, dtype=torch.int8)
        self.scale32 = torch.empty(n)
        for a in range(0, n, chunk):
            w = rows(a, min(a + chunk, n)).detach().float()
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.q[a:a + w.shape[0]] = (w / scale[:, None]).round().clamp(-127, 127)
            self.scale32[a:a + w.shape[0]] = scale
        self.scale = self.scale32.to(ACT_DTYPE)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._out = torch.empty(n)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per row"

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, in] -> [B, out] through ``gemm_int8_rows`` (fp32 activations, weights read once;
        a row's result does not depend on B). For decoding a few sequences at once."""
        y = gemm_int8_rows(self.q, self.scale32, x)
        if self.bias is not None:
            y += self.bias
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == self.in_features and x.dtype == torch.float32:
            y = gemv_int8(self.q, self.scale32, x.reshape(-1).contiguous(), self._out).clone()
            if self.bias is not None:
                y += self.bias
            return y.view(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE)
        y = torch._weight_int8pack_mm(x2, self.q, self.scale).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """Float32 weights of the batch path (bfloat16-rounded scales; one token uses the
        float32 scales)."""
        return self.q.float() * self.scale.float()[:, None]


class FloatLinear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with float ``W`` (fp32 or bf16). One fp32 token on the CPU goes
    through the C library's F32 GEMV (``sparseinfer.cpu``, its own thread pool; ``mats`` is then
    the weight as one ``QuantMatrix``) or, without it, ``sparse.kernels.gemv`` (numba); everything
    else through ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype),
                                        requires_grad=False) if bias else None)
        self._out = None
        self.mats: list = []
        self._plan = None

    def fill(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        dtype = self.weight.dtype
        if not (isinstance(weight, torch.nn.Parameter) and weight.dtype == dtype):
            weight = torch.nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
        self.weight = weight
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.to(dtype).contiguous(), requires_grad=False)
        self._out = torch.empty(self.out_features)
        w = self.weight
        if (w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
                and self.in_features % 32 == 0 and cpu_loads()):
            from .. import cpu

            raw = w.detach().view(torch.uint8).reshape(-1)  # the weight's own memory
            self.mats = [cpu.QuantMatrix("F32", raw, self.out_features, self.in_features)]
            self._plan = cpu.GemvPlan(self.mats, [self._out])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (self._out is not None and x.numel() == self.in_features and x.dtype == torch.float32
                and w.dtype == torch.float32 and w.device.type == "cpu"):
            if self._plan is not None and x.is_contiguous():
                self._plan(x.reshape(-1))
                y = self._out.clone()
            else:
                from ..sparse.kernels import gemv  # numba: imported on first use

                y = gemv(w, x.reshape(-1), self._out).clone()
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], -1)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, "
                f"{str(self.weight.dtype).replace('torch.', '')}, bias={self.bias is not None}")


class GGMLLinear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` held as GGUF blocks (Q4_0 ... Q6_K, F16) as the file
    stores them, usually a read-only view of the mapped file, or (Q4_0 / Q4_1 / Q8_0 of whole
    16-row panels) the same blocks rearranged in panels (``cpu.panels``). A fused weight
    (q/k/v, gate/up) is several such matrices sharing one input: one token is one ``sparseinfer.cpu`` GEMV call (the input quantized once, one pool dispatch);
    batches go through its blocked GEMM. ``dequantized`` (gguf-py) is the reference."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.mats: list = []
        self.bias = torch.empty(out_features) if bias else None
        self._plan = None

    def fill(self, parts: list[tuple[str, object, int]], bias: torch.Tensor | None = None) -> None:
        """``parts``: (GGUF type name, raw uint8 bytes [rows, bytes per row], rows) stacked."""
        from .. import cpu

        rows = sum(r for _, _, r in parts)
        if rows != self.out_features:
            raise ValueError(f"expected {self.out_features} rows in all, got {rows}")
        self.mats = [cpu.QuantMatrix(t, raw.reshape(-1) if hasattr(raw, "reshape") else raw, r,
                                     self.in_features) for t, raw, r in parts]
        self._out = torch.empty(self.out_features)
        outs = list(self._out.split([m.rows for m in self.mats]))
        self._plan = cpu.GemvPlan(self.mats, outs)
        self._gemm = cpu.gemm
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats)

    def extra_repr(self) -> str:
        kinds = "+".join(m.file_type + (" in 16-row panels" if m.file_type != m.type_name
                                        else " as stored") for m in self.mats) or "?"
        return f"in={self.in_features}, out={self.out_features}, {kinds}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == self.in_features:
            xv = x.reshape(-1)
            if xv.dtype != torch.float32 or not xv.is_contiguous():
                xv = xv.float().contiguous()
            self._plan(xv)
            # numpy's copy, on this thread: torch's copy of a vocabulary-sized output is a
            # parallel region, which woke its OpenMP pool every token to wait beside ours
            y = torch.from_numpy(self._out.numpy().copy())
        else:
            x2 = x.reshape(-1, self.in_features).float().contiguous()
            parts = [self._gemm(m, x2) for m in self.mats]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, in] -> [B, out] for a few sequences decoded together: ``forward`` (a lone row
        takes the GEMV, several the GEMM, whose every row is its GEMV bit for bit, so a row's
        result does not depend on B)."""
        return self.forward(x)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights (gguf-py's dequantization of the same bytes)."""
        from gguf import GGMLQuantizationType, quants

        parts = [quants.dequantize(m.file_rows(),
                                   GGMLQuantizationType[m.file_type]).reshape(m.rows, m.cols)
                 for m in self.mats]
        return torch.from_numpy(np.concatenate(parts).astype(np.float32))


def reference(module: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``module(x)`` computes, in plain torch: bfloat16-rounded input times the
    dequantized weights in float32."""
    return F.linear(x.to(ACT_DTYPE).float(), module.dequantized(), module.bias)
