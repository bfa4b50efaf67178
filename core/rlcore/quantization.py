"""Quantized checkpoints as published: which ``quantization_config`` rlcore loads, and how its weights become the
model they encode.

DeepSeek-V3 and Qwen3-FP8 are published in block FP8: each quantized linear weight is stored as ``float8_e4m3fn``
with a float32 companion ``<name>_scale_inv`` of shape ``[ceil(rows / b0), ceil(cols / b1)]``; the weight is the
FP8 value times its block's scale (the name says "inverse", but it is the multiplier), the blocks at the right and
bottom edges being partial. This is a checkpoint format, not a model family: the loader applies it to whatever a
model plugin's rules read. Anything else (GPTQ, AWQ, bitsandbytes, per-tensor FP8, another FP8 format) is refused
before a worker starts, since loading it as plain weights would silently train another model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class BlockFP8:
    """Block-quantized FP8 weights (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size: [b0, b1]``)."""
    block: tuple[int, int]

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """The float32 weight ``weight`` (FP8, [rows, cols]) encodes with one scale per block."""
        rows, cols = weight.shape
        b0, b1 = self.block
        expected = (-(-rows // b0), -(-cols // b1))
        if tuple(scale_inv.shape) != expected:
            raise ValueError(f"a [{rows}, {cols}] FP8 weight in {b0}x{b1} blocks needs a scale of shape "
                             f"{list(expected)}, the checkpoint has {list(scale_inv.shape)}")
        out = weight.to(torch.float32)
        for i, row_scales in enumerate(scale_inv.to(torch.float32)):   # one row of blocks at a time: little memory
            out[i * b0: (i + 1) * b0].mul_(row_scales.repeat_interleave(b1)[:cols])
        return out


def checkpoint_quantization(hf_config: dict) -> BlockFP8 | None:
    """The quantization the checkpoint's config.json declares, if rlcore can load it; raises ValueError naming
    ``quant_method`` and what to do otherwise."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8" and q.get("fmt", "e4m3") == "e4m3" and q.get("weight_block_size"):
        b0, b1 = q["weight_block_size"]
        return BlockFP8((int(b0), int(b1)))
    detail = f"quant_method {method!r}" + (f", fmt {q['fmt']!r}" if method == "fp8" and "fmt" in q else "") + (
        ", no weight_block_size" if method == "fp8" and not q.get("weight_block_size") else "")
    raise ValueError(f"its config.json declares quantization_config with {detail}, which rlcore cannot load as the "
                     f"model it encodes (it loads block FP8: quant_method 'fp8', fmt 'e4m3', weight_block_size): "
                     f"give the unquantized (bf16/fp32) checkpoint")
