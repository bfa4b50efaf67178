"""Correct MoE weight updates on vLLM's CPU build (0.32).

On the first load, vLLM's unquantized fused-MoE method pads the expert intermediate size and re-packs the expert
weights into the CPU grouped-GEMM kernel's layout (``UnquantizedFusedMoEMethod._setup_kernel`` calls the CPU
experts' ``process_weights_after_loading`` only while ``moe_kernel`` is None). A layer-wise reload runs the method's
``process_weights_after_loading`` again, but the kernel now exists, so the pad + re-pack is skipped and the
checkpoint-layout tensors are copied into the buffers the kernel reads as packed: logprobs moved by up to 4.5 after
pushing the unchanged checkpoint (and a shape error when the intermediate size needs padding).

The fix wraps each CPU MoE layer's ``process_weights_after_loading`` so that on a reload it finishes the job (pad +
re-pack the freshly loaded weights) before vLLM copies them back. Layers that receive no weights in a push are not
processed by the reload and stay untouched.
"""
from __future__ import annotations

from typing import Any

import torch


def _cpu_experts(layer: torch.nn.Module):
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch else None


def repack_moe_on_reload(model: torch.nn.Module) -> int:
    """Install the fix on every CPU MoE layer of a loaded vLLM model (idempotent); returns how many layers."""
    patched = 0
    for layer in model.modules():
        if _cpu_experts(layer) is None:
            continue
        method: Any = layer.quant_method
        if not getattr(method, "_rlcore_repacks_on_reload", False):
            original = method.process_weights_after_loading

            def process_weights_after_loading(lyr, _original=original, _method=method):
                reloading = _method.moe_kernel is not None
                _original(lyr)
                if reloading:
                    _method.moe_kernel.fused_experts.process_weights_after_loading(lyr)

            method.process_weights_after_loading = process_weights_after_loading
            method._rlcore_repacks_on_reload = True
        patched += 1
    return patched
