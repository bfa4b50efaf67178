"""The names a Megatron model's weights go by on one rank, made model-wide, and what kind each weight is (a MoE
expert's, a LoRA factor): the vocabulary that loading, the resharder, checkpoints and LoRA share. A module of its own
so that none of them imports another for it (``rlcore.lora.layers`` names the linears it adapts with it, while
the resharder reads the adapters)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

import torch

from rlcore.convert import WeightConverter

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def global_name(model: GPTModel, local_name: str, ep_rank: int | None = None) -> str:
    """Megatron numbers decoder layers per pipeline stage and experts per expert-parallel rank; the rules use
    model-wide indices. ``ep_rank``: whose experts (default: this rank's)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    layer = model.decoder.layers[int(m.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}.{local_name[m.end():]}"
    e = _EXPERT.search(name)
    if e:
        from megatron.core import parallel_state as mpu

        rank = mpu.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        first = rank * len(layer.mlp.experts.local_experts)
        name = f"{name[:e.start()]}.mlp.experts.local_experts.{first + int(e.group(1))}.{name[e.end():]}"
    return name


def named_weights(model: GPTModel, converter: WeightConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, tensor) of everything the HF checkpoint holds: the parameters, and the buffers that the model
    plugin's rules name: state kept outside the optimizer, such as a MoE router's expert bias (aux-loss-free load
    balancing), which megatron-core registers as a buffer. LoRA adapters' factors are not HF weights (the weights
    they adapt are sent merged: ``merged_weights``)."""
    yield from ((name, p) for name, p in model.named_parameters() if not is_adapter_parameter(name))
    for name, buffer in model.named_buffers():
        if global_name(model, name) in converter.by_megatron:
            yield name, buffer


def is_adapter_parameter(local_name: str) -> bool:
    return ".lora." in local_name


def is_expert(param: torch.Tensor) -> bool:
    """A parameter of a MoE expert: whole on its rank, never split over TP (expert TP is 1). ``build_gpt`` marks
    them allreduce=False at every layout (``mark_expert_parameters``), as the expert LoRA adapters are."""
    return getattr(param, "allreduce", True) is False
