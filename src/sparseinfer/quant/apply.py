"""Swap a loaded model's dense projections for quantized ones, in place (``--dtype q4``).

- attention (fused q/k/v, output) and a still-dense FFN (fused gate/up, down): 4-bit blocks.
  Where the GGUF stores the tensor as Q4_0 or Q4_1, its own blocks are used as they are
  (the q/k rows un-permuted like the float path); any other source is quantized with Q4_1's rule.
- the LM head: int8 per row (SmolLM2's head is the Q8_0 token embedding; per-row int8 is within
  its precision and torch has a fast CPU kernel for it). The token embedding itself stays float
  (one row is read per token).
- FFNs already taken by the sparse runtime keep their own storage (``--ffn-dtype``).
"""

from __future__ import annotations

import logging

import torch

from ..errors import SparseInferError
from ..models.loading import gguf_model_tensors, unpermute_qk
from ..models.model import FFN
from . import blocks as qb
from .linear import Int4Linear, Int8Linear

log = logging.getLogger(__name__)

QUANTIZED_DTYPES = ("q4",)
DTYPE_CHOICES = ("auto", "fp32", "bf16", "q4")


def auto_dtype(loaded) -> str:
    """What ``--dtype auto`` means for a file: "q4" when most of its layer projections are
    stored as Q4_0/Q4_1 blocks (keep the file's own quantization, as llama.cpp does), else
    "fp32"."""
    mats = [t.kind for t in loaded.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    n4 = sum(k in qb.BLOCK_BYTES for k in mats)
    if not (mats and 2 * n4 > len(mats)):
        return "fp32"
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu") or loaded.model.device.type != "cpu":
        log.warning("%s holds 4-bit weights but this torch (%s) or device cannot run them: "
                    "using fp32", loaded.path, torch.__version__)
        return "fp32"
    return "q4"


def gguf_q4_blocks(loaded) -> dict[str, qb.Q4Blocks]:
    """Canonical name -> the file's own 4-bit blocks, for every Q4_0/Q4_1 model tensor."""
    cfg = loaded.config
    out = {}
    for canon, t in gguf_model_tensors(loaded).items():
        kind = t.tensor_type.name
        if kind not in qb.BLOCK_BYTES or not canon.endswith(".weight"):
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        b = qb.from_gguf(t.data, kind, shape)
        heads = (cfg.n_heads if canon.endswith("attn.wq.weight") else
                 cfg.n_kv_heads if canon.endswith("attn.wk.weight") else None)
        if cfg.pos == "rope" and heads is not None:
            b = b.rows(unpermute_qk(torch.arange(shape[0]), heads))
        out[canon] = b
    return out


def quantize_model(loaded, dtype: str = "q4") -> dict[str, int]:
    """Replace the dense projections of ``loaded.model`` (CPU) by quantized modules.

    Returns counts: {"from_file": n, "requantized": n, "head": 0 or 1}.
    """
    if dtype not in QUANTIZED_DTYPES:
        raise SparseInferError(f"quantized dtype: expected one of {list(QUANTIZED_DTYPES)}, "
                               f"got {dtype!r}")
    model, cfg = loaded.model, loaded.config
    if model.device.type != "cpu":
        raise SparseInferError(f"--dtype {dtype}: 4-bit weights run on the CPU only, the model "
                               f"is on {model.device}")
    if cfg.d_model % qb.GROUP or cfg.d_ff % qb.GROUP:
        raise SparseInferError(f"--dtype {dtype}: expected d_model and d_ff to be multiples of "
                               f"{qb.GROUP}, found {cfg.d_model} and {cfg.d_ff}")
    file_blocks = gguf_q4_blocks(loaded)
    counts = {"from_file": 0, "requantized": 0, "head": 0}

    def blocks_for(lin, names: list[str]) -> qb.Q4Blocks:
        if all(n in file_blocks for n in names):
            counts["from_file"] += 1
            return qb.Q4Blocks.cat([file_blocks.pop(n) for n in names])
        counts["requantized"] += 1
        return qb.quantize(lin.weight)

    def swap(owner, attr: str, names: list[str]) -> None:
        lin = getattr(owner, attr)
        setattr(owner, attr, Int4Linear(blocks_for(lin, names), lin.bias))

    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        swap(block.attn, "wqkv", [p + f"attn.{n}.weight" for n in ("wq", "wk", "wv")])
        swap(block.attn, "wo", [p + "attn.wo.weight"])
        if isinstance(block.ffn, FFN):
            ins = ["gate", "up"] if block.ffn.gated else ["up"]
            swap(block.ffn, "w_in", [p + f"ffn.{n}.weight" for n in ins])
            swap(block.ffn, "down", [p + "ffn.down.weight"])
    head = model.lm_head
    model.lm_head = Int8Linear(head.weight, head.bias)
    counts["head"] = 1
    log.info("quantized weights (%s): %d projections from the file's 4-bit blocks, %d "
             "quantized here, int8 LM head", dtype, counts["from_file"], counts["requantized"])
    return counts
