"""`rlcore export <checkpoint> <out dir>`: from a run checkpoint, whatever layout saved it, with no rollout engine,
an HF checkpoint (config.json, sharded safetensors with an index, tokenizer) loadable by transformers and vLLM; or,
from a LoRA run's checkpoint, PEFT's adapter directory (adapter_config.json, adapter_model.safetensors, tokenizer)
for ``peft.PeftModel.from_pretrained(<base>, out)``, or with ``--merged`` the merged HF checkpoint.

Nothing is built but the model's structure on the meta device (``build_gpt(structure_only=True)``): its
``sharded_state_dict`` says where each parameter lives in megatron-core's distributed checkpoint, so the weights are
read from it a bucket at a time, converted to HF through the model plugin's rules and written as they come. Memory
stays at about one bucket, at any model size (the optimizer state is never read).

A LoRA checkpoint holds the adapters; the frozen base weights are where the run read them (rlcore_checkpoint.json's
model.path: HF files, or ``rlcore convert``'s distributed checkpoint), or, in checkpoints from before, in the
checkpoint itself. The merged export reads each base tensor from there and adds scale * lora_B lora_A per HF
projection, from the same PEFT factors the adapter export writes (``rlcore.lora.peft``)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from rlcore.errors import ConfigError
from rlcore.hf_checkpoint import HFCheckpoint, TensorSpec
from rlcore.converted import ConvertedWeights
from rlcore.specs import ModelSpec

if TYPE_CHECKING:
    from rlcore.lora.config import LoRAConfig

# what a LoRA run's weights are merged onto: HF files, a converted distributed checkpoint, or (None) the run's own
# checkpoint, which held the base weights before LoRA checkpoints became adapter-sized
BaseWeights = HFCheckpoint | ConvertedWeights | None


class SavedModel:
    """The model saved in ``directory`` (megatron-core's distributed checkpoint of rlcore's ``save_model``), built as
    structure only, with its adapters when the run trained LoRA (``lora``: actor.lora). Needs a world of one
    (``init_parallel()``)."""

    def __init__(self, directory: str, spec: ModelSpec, hf_config: dict, dtype: str, lora: LoRAConfig | None = None):
        from rlcore.lora.layers import ColumnLoRA, add_lora
        from rlcore.megatron.model import build_gpt
        from rlcore.megatron.names import named_weights
        from rlcore.megatron.reshard import adapted_weights

        self.directory = directory
        model, self.converter = build_gpt(spec, hf_config, dtype, structure_only=True)
        if lora is not None:
            add_lora(model, lora)
        self.adapted = adapted_weights(model)    # weight name -> its adapter (factors: <linear>.lora.A / .B)
        self.column = {name: isinstance(a, ColumnLoRA) for name, a in self.adapted.items()}
        self.located = model.sharded_state_dict()
        self.params = list(named_weights(model, self.converter))
        # each weight's HF tensors, in the order the stream yields them
        self.hf = {n: [TensorSpec(hf, tuple(t.shape), p.dtype) for hf, t in self.converter.to_hf(n, [p])]
                   for n, p in self.params}
        self.specs = [s for n, _ in self.params for s in self.hf[n]]

    def factors(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint keys of the adapter factors of weight ``name`` (A, B) with their meta tensors."""
        prefix = f"{name[:-len('weight')]}lora."
        return [(prefix + f, getattr(self.adapted[name], f)) for f in ("A", "B")]

    def read(self, wanted: list[tuple[str, torch.Tensor]], directory: str | None = None) -> dict[str, torch.Tensor]:
        """The named tensors (this model's names, with their meta tensors) from ``directory`` (default: the
        checkpoint), each whole as the structure holds it (a gated fc1 merged from its stored halves)."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
        from megatron.core.dist_checkpointing.mapping import (ShardedTensorFactory, apply_factories,
                                                              apply_factory_merges)

        from rlcore.megatron.checkpoint import read_regions

        request = {name: dataclasses.replace(self.located[name], data=torch.empty(p.shape, dtype=p.dtype))
                   for name, p in wanted}
        factories = {n: v for n, v in request.items() if isinstance(v, ShardedTensorFactory)}
        apply_factories(request)     # e.g. a gated fc1 is stored as its gate and up halves
        regions: dict = {}
        for sh in nested_values(request):   # where each piece lives: its key, and its place in the key's
            shape = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)   # tensor (layers and experts stacked)
            regions.setdefault(sh.key, []).append((tuple(sh.global_offset), sh.data.view(shape)))
        read_regions(directory or self.directory, regions)
        return apply_factory_merges(dict_list_map_inplace(lambda sh: sh.data, request), factories)

    def peft_factors(self, name: str, loaded: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        from rlcore.lora.peft import peft_factors

        (a, _), (b, _) = self.factors(name)
        return peft_factors(self.converter, name, [loaded.pop(a)], [loaded.pop(b)], self.column[name])

    def peft_adapters(self, bucket_bytes: int = 1 << 30) -> Iterator[tuple[str, bool, list[tuple[str, torch.Tensor,
                                                                                                  torch.Tensor]]]]:
        """Per adapted Megatron weight: (its name, column-parallel, its PEFT factors ``(HF module, lora_A,
        lora_B)``), reading a bucket of factors at a time."""
        for bucket in self.buckets(list(self.adapted), bucket_bytes):
            loaded = self.read([f for name in bucket for f in self.factors(name)])
            for name in bucket:
                yield name, self.column[name], self.peft_factors(name, loaded)

    def buckets(self, names: list[str], bucket_bytes: int) -> list[list[str]]:
        """Consecutive weights of at most ``bucket_bytes`` (a larger one alone)."""
        sizes = {n: p.nbytes for n, p in self.params}
        buckets: list[list[str]] = [[]]
        size = 0
        for name in names:
            if buckets[-1] and size + sizes[name] > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += sizes[name]
        return buckets


def checkpoint_hf_weights(directory: str, spec: ModelSpec, hf_config: dict, dtype: str,
                          bucket_bytes: int = 1 << 30, lora: LoRAConfig | None = None, base: BaseWeights = None
                          ) -> tuple[list[TensorSpec], Iterator[tuple[str, torch.Tensor]]]:
    """The HF tensors of the model saved in ``directory``, as their list and a stream that reads ``bucket_bytes``
    of Megatron tensors at a time. ``lora``: the run trained LoRA adapters (actor.lora); each adapted HF tensor is
    written merged, W + scale * lora_B lora_A, as the run's own export writes it. ``base``: where the weights that
    were not trained are (None: in the checkpoint)."""
    model = SavedModel(directory, spec, hf_config, dtype, lora)

    def base_tensors(name: str, loaded: dict) -> list[tuple[str, torch.Tensor]]:
        if isinstance(base, HFCheckpoint):
            return [(s.name, _base_tensor(base, s)) for s in model.hf[name]]
        return model.converter.to_hf(name, [loaded.pop(name)])

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        from rlcore.lora.layers import merge

        params = dict(model.params)
        for bucket in model.buckets([n for n, _ in model.params], bucket_bytes):
            factors = [f for name in bucket if name in model.adapted for f in model.factors(name)]
            loaded = model.read(factors)
            if not isinstance(base, HFCheckpoint):
                loaded |= model.read([(name, params[name]) for name in bucket],
                                     base.directory if isinstance(base, ConvertedWeights) else None)
            for name in bucket:
                tensors = base_tensors(name, loaded)
                if name in model.adapted:
                    deltas = {f"{module}.weight": (a, b) for module, a, b in model.peft_factors(name, loaded)}
                    scale = model.adapted[name].scale
                    tensors = [(hf, merge(t, *deltas[hf], scale) if hf in deltas else t) for hf, t in tensors]
                yield from tensors

    return model.specs, stream()


def _base_tensor(base: HFCheckpoint, spec: TensorSpec) -> torch.Tensor:
    """A base tensor as the checkpoint's model holds it (in the actor's dtype, as the run loaded it)."""
    name, shape = spec.name, spec.shape
    if name not in base:
        raise ConfigError(f"the base weights {base.path} lack {name!r}, which the checkpoint's model has: give the "
                          f"HF checkpoint the run started from (--base)")
    tensor = base[name]
    if tuple(tensor.shape) != shape:
        raise ConfigError(f"the base weights {base.path} hold {name!r} as {tuple(tensor.shape)}, the checkpoint's "
                          f"model as {shape}: give the HF checkpoint the run started from (--base)")
    return tensor.to(spec.dtype)


def checkpoint_peft_adapter(directory: str, spec: ModelSpec, hf_config: dict, dtype: str, lora: LoRAConfig,
                            base_model: str | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The LoRA adapters saved in ``directory`` as PEFT's adapter: the state dict of ``adapter_model.safetensors``
    and ``adapter_config.json`` (``base_model``: its base_model_name_or_path). Adapter-sized."""
    from rlcore.lora.peft import adapter_config, peft_adapter

    model = SavedModel(directory, spec, hf_config, dtype, lora)
    state, modules, parameters = peft_adapter(((name, factors) for name, _, factors in model.peft_adapters()),
                                              model.converter.hf_names(), spec.module_name)
    return state, adapter_config(lora, modules, base_model, parameters)


def write_peft_adapter(out: str, state: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's adapter directory: ``adapter_model.safetensors`` (``state``) and ``adapter_config.json``
    (``config``, ``rlcore.lora.peft.adapter_config``)."""
    from safetensors.torch import save_file

    from rlcore.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def export_checkpoint(path: str, out: str, plugin_names: list[str] | None = None,
                      max_shard_bytes: int = 5 * 10**9, merged: bool = False, base: str | None = None) -> str:
    """Write ``out`` from the checkpoint ``path``; returns what it wrote (for the user). A LoRA checkpoint gives
    PEFT's adapter directory, or with ``merged`` the merged HF checkpoint; ``base``: the HF directory the run
    started from, where the checkpoint's record of it is stale."""
    from rlcore.checkpoint import STATE
    from rlcore.config import config_from_dict
    from rlcore.lora.config import lora_config
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
    lora = lora_config(cfg.actor.lora, cfg.run.seed)
    if lora is None and base is not None:
        raise ConfigError(f"--base {base}: {path} is a full fine-tuning checkpoint, which holds all its weights; "
                          "drop --base")
    weights = os.path.join(path, "actor", "model")
    init_parallel()
    if lora is not None and not merged:
        write_peft_adapter(out, *checkpoint_peft_adapter(weights, spec, hf_config, cfg.actor.dtype, lora,
                                                         base or state["model"].get("path")))
        wrote = "adapter_config.json, adapter_model.safetensors, tokenizer: a PEFT adapter"
    else:
        base_weights = lora_base(path, state, base) if lora is not None else None
        specs, stream = checkpoint_hf_weights(weights, spec, hf_config, cfg.actor.dtype, lora=lora,
                                              base=base_weights)
        save_hf(stream, specs, hf_config, out, max_shard_bytes)
        wrote = "config.json, safetensors, tokenizer" + (": LoRA merged" if lora is not None else "")
    tokenizer = os.path.join(path, "tokenizer")
    for name in os.listdir(tokenizer) if os.path.isdir(tokenizer) else []:
        shutil.copy(os.path.join(tokenizer, name), os.path.join(out, name))
    return wrote


def lora_base(path: str, state: dict, base: str | None) -> BaseWeights:
    """Where the base weights of the LoRA checkpoint ``path`` are: ``base`` (--base) or the directory the run
    started from (rlcore_checkpoint.json model.path), which must still be there and hold the weights the run
    fingerprinted (model.base); None for a checkpoint from before that record, which holds them itself."""
    from rlcore.lora.base import base_differences
    from rlcore.megatron.model import starting_weights

    where = base or state["model"].get("path")
    if where is None:
        return None
    source = "--base" if base else f"model.path in {path}'s rlcore_checkpoint.json"
    if not os.path.isdir(where):
        raise ConfigError(f"the LoRA checkpoint {path}'s adapters apply to the base weights in {where!r} ({source}), "
                          f"which is not a directory: pass --base <the HF checkpoint the run started from>")
    recorded = state["model"].get("base")
    if recorded is not None:
        differ = base_differences(recorded, where)
        if differ:
            raise ConfigError(f"the LoRA checkpoint {path}'s adapters were trained on other base weights than "
                              f"{where!r} ({source}) holds: {', '.join(differ[:3])} differ; pass --base <the HF "
                              f"checkpoint the run started from>")
    return starting_weights(where)
