"""Build a Megatron GPTModel from a model plugin's spec, and move weights between it and HF checkpoints."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import nullcontext
from itertools import chain
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from rlcore.convert import Layout, Rename, WeightConverter
from rlcore.hf_checkpoint import HFCheckpoint, TensorSpec, unused_names, write_sharded
from rlcore.hf_checkpoint import log as load_log
from rlcore.hf_config import read_config_json, with_transformers_defaults
from rlcore.converted import ConvertedWeights, is_converted
from rlcore.quantization import checkpoint_quantization
from rlcore.specs import ModelSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


# Fused kernels that need CUDA / TransformerEngine / Apex; off unless running on CUDA.
_CPU_OFF = dict(gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_hf_config(path: str) -> dict:
    """A checkpoint directory's config.json (or that file itself), as transformers reads it."""
    return with_transformers_defaults(read_config_json(path))


def read_hf_weights(path: str) -> HFCheckpoint:
    """The checkpoint's weights, read lazily tensor by tensor (``rlcore.hf_checkpoint``)."""
    return HFCheckpoint(path)


def starting_weights(path: str) -> HFCheckpoint | ConvertedWeights:
    """What a trained model loads its shard from: a converted checkpoint's Megatron weights (``rlcore convert``), or
    the HF files."""
    return ConvertedWeights(path) if is_converted(path) else HFCheckpoint(path)


# actor/critic.recompute -> megatron-core's activation recompute options. selective: the core attention's
# activations (the [heads x seq x seq] scores) are recomputed; full: each transformer layer keeps only its input and
# reruns its forward in the backward pass.
RECOMPUTE: dict[str, dict] = {
    "none": {}, "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def transformer_config(spec: ModelSpec, hf_config: dict, dtype: str = "float32", *, tp: int = 1, pp: int = 1,
                       cp: int = 1, ep: int = 1, sequence_parallel: bool = False, last_stage_layers: int = 0,
                       recompute: str = "none", cpu_initialization: bool = False, routing_replay: bool = False):
    """The plugin's TransformerConfig for these parallel sizes (Megatron validates them on construction).
    ``cpu_initialization``: Megatron's layers create their weights without naming a device (so that a
    ``torch.device("meta")`` context applies: ``build_gpt(structure_only=True)``). ``routing_replay``: MoE routers
    can replay given routes (``rlcore.megatron.routing_replay``)."""
    torch_dtype = DTYPES[dtype]
    overrides = dict(params_dtype=torch_dtype, pipeline_dtype=torch_dtype, bf16=torch_dtype == torch.bfloat16,
                     use_cpu_initialization=cpu_initialization, tensor_model_parallel_size=tp,
                     pipeline_model_parallel_size=pp, context_parallel_size=cp, sequence_parallel=sequence_parallel,
                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1, **RECOMPUTE[recompute])
    if last_stage_layers:
        overrides["num_layers_in_last_pipeline_stage"] = last_stage_layers
    if routing_replay:
        overrides["moe_enable_routing_replay"] = True
    if not torch.cuda.is_available():
        overrides.update(_CPU_OFF)
    return spec.transformer_config(hf_config, **overrides)


def check_model_config(spec: ModelSpec, hf_config: dict, dtype: str = "float32") -> None:
    """The checkpoint's quantization (if any) is one rlcore loads, its architecture is the family's, and everything
    the model plugin derives from ``hf_config`` (TransformerConfig, GPTModel arguments, weight rules) builds, without
    building a model: a mismatch, or a value the plugin cannot map, raises a ValueError here."""
    checkpoint_quantization(hf_config)          # a quantization rlcore cannot load is refused, naming it
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in spec.hf_architectures:
        raise ValueError(f"it holds a {arch} checkpoint but model.family {spec.name!r} handles "
                         f"{', '.join(spec.hf_architectures)}")
    config = transformer_config(spec, hf_config, dtype)
    spec.gpt_kwargs(hf_config)
    weight_rules(spec, config, hf_config)


def build_gpt(spec: ModelSpec, hf_config: dict, dtype: str = "float32", sequence_parallel: bool = False,
              last_stage_layers: int = 0, recompute: str = "none", structure_only: bool = False,
              routing_replay: bool = False):
    """The local (this rank's) GPTModel and the converter bound to it. ``structure_only``: every tensor on the meta
    device, nothing allocated: the model's names, shapes and checkpoint layout (``sharded_state_dict``) at any
    size."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, hf_config, dtype, tp=mpu.get_tensor_model_parallel_world_size(),
                                pp=mpu.get_pipeline_model_parallel_world_size(),
                                cp=mpu.get_context_parallel_world_size(),
                                ep=mpu.get_expert_model_parallel_world_size(), sequence_parallel=sequence_parallel,
                                last_stage_layers=last_stage_layers, recompute=recompute,
                                cpu_initialization=structure_only, routing_replay=routing_replay)
    model_class, more = GPTModel, {}
    if spec.vision is not None:
        from rlcore.megatron.vision import VisionLanguageGPT

        model_class, more = VisionLanguageGPT, dict(vision=spec.vision, hf_config=hf_config)
    with torch.device("meta") if structure_only else nullcontext():
        model = model_class(config, spec.layer_spec(config), pre_process=mpu.is_pipeline_first_stage(),
                            post_process=mpu.is_pipeline_last_stage(), **spec.gpt_kwargs(hf_config), **more)
    mark_expert_parameters(model)
    layout = Layout(num_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
                    head_dim=config.kv_channels, vocab_size=hf_config["vocab_size"])
    converter = WeightConverter(weight_rules(spec, config, hf_config), config.num_layers, layout,
                                num_experts=config.num_moe_experts or 0)
    return model, converter


def weight_rules(spec: ModelSpec, config, hf_config: dict) -> list:
    """The family's rules, and a vision-language family's tower weights under their checkpoint names."""
    rules = spec.weight_rules(config, hf_config)
    if spec.vision is not None:
        from rlcore.megatron.vision import tower_shapes

        tower = tower_shapes(spec.vision, hf_config)
        rules += [Rename(f"vision.{name}", spec.vision.hf_prefix + name) for name in tower]
    return rules


def mark_expert_parameters(model: GPTModel) -> None:
    """Mark every routed expert's parameters ``allreduce=False`` at every layout, as megatron-core does only when
    EP > 1: Megatron DDP and the optimizer then reduce their gradients over the expert-data-parallel group, which
    holds the TP ranks (expert TP is 1). Under sequence parallelism each TP rank runs the experts on its own part of
    the tokens, so its expert gradient is a partial sum; left dense (reduced over data parallelism only), each TP
    rank would update its copy of the experts with its own part alone."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def load_hf_into(model: GPTModel, converter: WeightConverter, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every weight from ``hf_state`` into ``model``, one tensor at a time: from an
    ``HFCheckpoint``, only the tensors this rank's rules ask for are read, and none is kept once copied."""
    from megatron.core import parallel_state as mpu

    from rlcore.megatron.names import global_name, is_expert, named_weights

    params = {global_name(model, n): p for n, p in named_weights(model, converter)}
    experts = {n: p for n, p in params.items() if is_expert(p)}     # whole experts: not split over TP
    dense = {n: p for n, p in params.items() if n not in experts}
    tensors = chain(converter.megatron_from_hf(hf_state, dense.items(), mpu.get_tensor_model_parallel_rank(),
                                               mpu.get_tensor_model_parallel_world_size()),
                    converter.megatron_from_hf(hf_state, experts.items()))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(hf_state, HFCheckpoint):
        hf_state.progress = rank == 0
    with torch.no_grad():
        for name, value in tensors:
            if value.shape != params[name].shape:
                raise ValueError(f"HF weights give {name} shape {tuple(value.shape)}, model has "
                                 f"{tuple(params[name].shape)}: the checkpoint does not match its config.json")
            params[name].copy_(value)
    if isinstance(hf_state, HFCheckpoint):
        extra_layers, other = unused_names(hf_state, set(converter.hf_names()), model.config.num_layers)
        _log_load(hf_state, extra_layers, other, model.config.num_layers, rank)
        _check_tower_read(model, hf_state.path, other)


def _check_tower_read(model, path: str, unread_names: list[str]) -> None:
    """A vision-language checkpoint's tower weights are all read, or the load fails: one left out would leave its
    parameter as initialised (a silently random vision tower after a rename, as peers shipped)."""
    vision = getattr(model, "vision_spec", None)
    unread = [name for name in unread_names if vision is not None and name.startswith(vision.hf_prefix)]
    if unread:
        raise ValueError(f"{path}: {len(unread)} vision tower tensor(s) no weight rule reads, e.g. "
                         f"{', '.join(unread[:3])}: the checkpoint's tower is not the one its config.json builds")


def _log_load(checkpoint: HFCheckpoint, extra_layers: list[int], other: list[str], num_layers: int,
              rank: int) -> None:
    """What this rank read; and, once, what no rule reads (``unused_names``: MTP layers, stray tensors): skipped,
    never loaded into another layer."""
    load_log.info("rank %d: %s", rank, checkpoint.summary())
    if rank:
        return
    if extra_layers:
        load_log.info("%s: skipped decoder layer(s) %s beyond the model's %d (multi-token prediction: not "
                      "trained, not exported)", checkpoint.path, ", ".join(map(str, extra_layers)), num_layers)
    if other:
        load_log.warning("%s: %d tensor(s) no weight rule reads were not loaded, e.g. %s", checkpoint.path,
                         len(other), ", ".join(other[:3]))


def save_hf(hf_weights: Iterator[tuple[str, torch.Tensor]], specs: list[TensorSpec], hf_config: dict,
            directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
    """Write config.json and the weights (tensors only; no pickled code) as HF's sharded safetensors, streamed:
    ``specs`` names the stream's tensors in order. The weights written are not quantized, so config.json loses any
    ``quantization_config``."""
    write_sharded(directory, specs, hf_weights, max_shard_bytes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({k: v for k, v in hf_config.items() if k != "quantization_config"}, f, indent=2)
