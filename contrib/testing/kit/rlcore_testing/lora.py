"""Random LoRA adapters for the equivalence tests: drawn per HF projection as PEFT holds them (q/k/v or gate/up
sharing A), seeded by the layer's model-wide name so every layout draws the same, and put into rlcore's fused,
TP-split layout by the model's own weight rules (B's rows split like W's rows, a row-parallel A's columns like W's
columns). Returns what they must equal: the HF weights merged, W + B A * scale."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


def set_random_adapters(model, converter, hf: dict[str, torch.Tensor], cfg, std: float) -> dict[str, torch.Tensor]:
    """Fill every adapter of ``model`` (this rank's part; ``converter`` its weight rules, ``hf`` the whole HF
    checkpoint it was built from, ``cfg`` its LoRAConfig) with random A and B of standard deviation ``std``; returns
    ``hf`` with each adapted projection merged."""
    from rlcore.lora.layers import ColumnLoRA, LoRAAdapter
    from rlcore.megatron.names import global_name

    merged = dict(hf)
    for name, module in model.named_modules():
        adapter = getattr(module, "lora", None)
        if not isinstance(adapter, LoRAAdapter):
            continue
        rule = converter.rule(global_name(model, f"{name}.weight"))
        g = torch.Generator().manual_seed(zlib.crc32(rule.megatron.encode()))   # the layer's (expert's) global name
        names = rule.hf_names()
        A = torch.randn(cfg.rank, hf[names[0]].shape[1], generator=g) * std
        B = {n: torch.randn(hf[n].shape[0], cfg.rank, generator=g) * std for n in names}
        size, rank = (dist.get_world_size(adapter.tp_group), dist.get_rank(adapter.tp_group)) if adapter.tp_size > 1 \
            else (1, 0)
        with torch.no_grad():
            if isinstance(adapter, ColumnLoRA):
                adapter.A.copy_(A)
                adapter.B.copy_(rule.from_hf(B, converter.layout, rank, size, adapter.B.shape))
            else:
                adapter.A.copy_(rule.from_hf({names[0]: A}, converter.layout, rank, size, adapter.A.shape))
                adapter.B.copy_(B[names[0]])
        for n in names:
            merged[n] = hf[n] + B[n] @ A * cfg.scale
    return merged
