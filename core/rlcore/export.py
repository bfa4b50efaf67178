"""`rlcore export <checkpoint> <out dir>`: an HF checkpoint (config.json, sharded safetensors with an index,
tokenizer) from a run checkpoint, whatever layout saved it, with no rollout engine; loadable by transformers and
vLLM. A LoRA run's checkpoint is exported merged (a plain HF model).

Nothing is built but the model's structure on the meta device (``build_gpt(structure_only=True)``): its
``sharded_state_dict`` says where each parameter lives in megatron-core's distributed checkpoint, so the weights are
read from it a bucket at a time, converted to HF through the model plugin's rules and written as they come. Memory
stays at about one bucket, at any model size (the optimizer state is never read)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from rlcore.errors import ConfigError
from rlcore.hf_checkpoint import TensorSpec
from rlcore.specs import ModelSpec

if TYPE_CHECKING:
    from rlcore.megatron.lora import LoRAConfig


def checkpoint_hf_weights(directory: str, spec: ModelSpec, hf_config: dict, dtype: str,
                          bucket_bytes: int = 1 << 30, lora: LoRAConfig | None = None
                          ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
    """The HF tensors of the model saved in ``directory`` (megatron-core's distributed checkpoint of rlcore's
    ``save_model``), as their list and a stream that reads ``bucket_bytes`` of Megatron tensors at a time. Needs a
    world of one (``init_parallel()``). ``lora``: the run trained LoRA adapters (actor.lora); each adapted weight is
    read with its adapter's factors and written merged (W + B A * scale), as the run's own export writes it."""
    from rlcore.megatron.lora import add_lora
    from rlcore.weight_sync.reshard import adapted_weights, named_weights
    from rlcore.megatron.model import build_gpt

    model, converter = build_gpt(spec, hf_config, dtype, structure_only=True)
    if lora is not None:
        add_lora(model, lora)
    adapted = adapted_weights(model)    # weight name -> its adapter (the factors' names: <linear>.lora.A / .B)
    located = model.sharded_state_dict()
    params = list(named_weights(model, converter))
    specs = [TensorSpec(name, tuple(t.shape), p.dtype) for n, p in params for name, t in converter.to_hf(n, [p])]
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in params:
        if buckets[-1] and size + p.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += p.nbytes

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
        from megatron.core.dist_checkpointing.mapping import (ShardedTensorFactory, apply_factories,
                                                              apply_factory_merges)

        from rlcore.megatron.checkpoint import read_regions
        from rlcore.megatron.lora import merge

        for bucket in buckets:
            wanted = [(name, p) for name, p in bucket]
            wanted += [(f"{name[:-len('weight')]}lora.{factor}", getattr(adapted[name], factor))
                       for name, _ in bucket if name in adapted for factor in ("A", "B")]
            request = {name: dataclasses.replace(located[name], data=torch.empty(p.shape, dtype=p.dtype))
                       for name, p in wanted}
            factories = {n: v for n, v in request.items() if isinstance(v, ShardedTensorFactory)}
            apply_factories(request)     # e.g. a gated fc1 is stored as its gate and up halves
            regions: dict = {}
            for sh in nested_values(request):   # where each piece lives: its key, and its place in the key's
                shape = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)   # tensor (layers and experts stacked)
                regions.setdefault(sh.key, []).append((tuple(sh.global_offset), sh.data.view(shape)))
            read_regions(directory, regions)
            loaded = apply_factory_merges(dict_list_map_inplace(lambda sh: sh.data, request), factories)
            for name, _ in bucket:
                weight = loaded.pop(name)
                if name in adapted:
                    factors = f"{name[:-len('weight')]}lora."
                    weight = merge(weight, loaded.pop(factors + "A"), loaded.pop(factors + "B"), adapted[name].scale)
                yield from converter.to_hf(name, [weight])

    return specs, stream()


def export_checkpoint(path: str, out: str, plugin_names: list[str] | None = None,
                      max_shard_bytes: int = 5 * 10**9) -> str:
    from rlcore.checkpoint import STATE
    from rlcore.config import config_from_dict
    from rlcore.config.loader import lora_config
    from rlcore.megatron.model import save_hf
    from rlcore.megatron.parallel import init_parallel
    from rlcore.plugins import load_plugins

    state_file = os.path.join(path, STATE)
    if not os.path.isfile(state_file):
        raise ConfigError(f"{path!r} is not a complete rlcore checkpoint (no {STATE}): give a <run dir>/checkpoints/"
                          f"step_<N> directory")
    with open(state_file) as f:
        state = json.load(f)
    cfg = config_from_dict(state["config"])
    spec = load_plugins(plugin_names).registry.get("models", state["model"]["family"])
    hf_config = state["model"]["hf_config"]
    init_parallel()
    specs, tensors = checkpoint_hf_weights(os.path.join(path, "actor", "model"), spec, hf_config, cfg.actor.dtype,
                                           lora=lora_config(cfg.actor.lora, cfg.run.seed))
    save_hf(tensors, specs, hf_config, out, max_shard_bytes)
    tokenizer = os.path.join(path, "tokenizer")
    for name in os.listdir(tokenizer) if os.path.isdir(tokenizer) else []:
        shutil.copy(os.path.join(tokenizer, name), os.path.join(out, name))
    return out
