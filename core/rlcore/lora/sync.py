"""Adapters-only weight sync (``rollout.lora=adapters``): the engine keeps the base weights it started from and gets
only the LoRA adapters' factors after each update, in PEFT's names and layout (``rlcore.lora.peft``).

The factors are r wide, so they are gathered whole on every rank, not bucketed through the resharder: each TP shard
of each adapter (column-parallel: B split by W's rows; row-parallel: A split by W's columns; the other factor
replicated) has one *writer*, the lowest global rank holding it, as in ``rlcore.megatron.reshard``. A sync is one
all-gather of every rank's written factors, flat and padded to the largest rank's share; then every rank maps each
adapted weight's shards to its HF projections' ``lora_A`` / ``lora_B`` (``peft_factors``), so that every engine
(one per rank, colocated) or global rank 0 (the push to async rollout workers) holds the whole adapter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rlcore.convert import WeightConverter
from rlcore.lora.peft import adapter_config, peft_adapter, peft_factors
from rlcore.megatron.reshard import adapted_weights

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from rlcore.lora.config import LoRAConfig
    from rlcore.lora.layers import LoRAAdapter


@dataclass(frozen=True)
class _Shard:
    """One rank's factors of one adapted weight: TP shard ``index`` of ``count``."""
    name: str                       # the adapted weight's global Megatron name
    index: int
    count: int
    column: bool                    # ColumnLoRA (else RowLoRA)
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.a_shape) + _numel(self.b_shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class AdapterSync:
    """Built once per model on every rank (collective over the default group); ``tensors()`` (collective) gives the
    whole adapter as PEFT's state dict on every rank, ``config`` its ``adapter_config.json``."""

    def __init__(self, model: GPTModel, converter: WeightConverter, lora: LoRAConfig, base_path: str | None,
                 engine: bool = True, module_name: Callable[[str], str] | None = None):
        """``module_name``: the family's names of transformers' modules (``ModelSpec.module_name``)."""
        from rlcore.lora.layers import ColumnLoRA

        self.converter, self.module_name = converter, module_name
        self.adapters: dict[str, LoRAAdapter] = adapted_weights(model)
        if not self.adapters:
            raise ValueError("rollout.lora=adapters: the actor has no LoRA adapters (actor.lora.rank is 0)")
        experts = sorted(name for name, a in self.adapters.items() if getattr(a, "expert", False))
        if experts and engine:   # the end-of-run adapter export (engine=False) takes them, in PEFT's stacked form
            raise ValueError(f"rollout.lora=adapters does not send MoE experts' adapters yet ({experts[0]}, ...): use "
                             "rollout.lora=merged, or leave linear_fc1/linear_fc2 out of actor.lora.target_modules")
        self.dtype = next(iter(self.adapters.values())).A.dtype
        held = [_Shard(name, dist.get_rank(a.tp_group) if a.tp_size > 1 else 0, a.tp_size, isinstance(a, ColumnLoRA),
                       tuple(a.A.shape), tuple(a.B.shape)) for name, a in self.adapters.items()]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)
        # rank r writes plan[r], in order; a shard that several ranks hold (data-parallel replicas) is written once
        self.plan: list[list[_Shard]] = [[] for _ in everyone]
        self.shards: dict[str, list[_Shard | None]] = {}
        for rank, shards in enumerate(everyone):
            for s in shards:
                slots = self.shards.setdefault(s.name, [None] * s.count)
                if slots[s.index] is None:
                    slots[s.index] = s
                    self.plan[rank].append(s)
        self.padded = max(sum(s.numel for s in shards) for shards in self.plan)
        _, modules, parameters = peft_adapter(((name, self._peft_factors(name, *self._meta(slots)))
                                               for name, slots in self.shards.items()), converter.hf_names(),
                                              module_name)
        self.config = adapter_config(lora, modules, base_path, parameters)

    def _meta(self, slots: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([torch.empty(s.a_shape, dtype=self.dtype, device="meta") for s in slots],
                [torch.empty(s.b_shape, dtype=self.dtype, device="meta") for s in slots])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Collective: the whole adapter, keyed as PEFT's ``adapter_model.safetensors``."""
        mine = self.plan[dist.get_rank()]
        device = next(iter(self.adapters.values())).A.device
        flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
        offset = 0
        for s in mine:
            adapter = self.adapters[s.name]
            for factor in (adapter.A, adapter.B):
                flat[offset: offset + factor.numel()].copy_(factor.detach().reshape(-1))
                offset += factor.numel()
        gathered = [torch.empty_like(flat) for _ in self.plan]
        dist.all_gather(gathered, flat)
        factors: dict[str, list] = {name: [None] * len(slots) for name, slots in self.shards.items()}
        for buffer, shards in zip(gathered, self.plan):
            buffer, offset = buffer.cpu(), 0
            for s in shards:
                a = buffer[offset: offset + _numel(s.a_shape)].view(s.a_shape).clone()   # tensors of their own:
                offset += _numel(s.a_shape)                                              # safetensors refuses views
                factors[s.name][s.index] = (a, buffer[offset: offset + _numel(s.b_shape)].view(s.b_shape).clone())
                offset += _numel(s.b_shape)
        return peft_adapter(((name, self._peft_factors(name, [a for a, _ in pairs], [b for _, b in pairs]))
                             for name, pairs in factors.items()), self.converter.hf_names(), self.module_name)[0]

    def _peft_factors(self, name: str, a_shards: list[torch.Tensor], b_shards: list[torch.Tensor]) -> list:
        return peft_factors(self.converter, name, a_shards, b_shards, column=self._column(name))

    def _column(self, name: str) -> bool:
        first = self.shards[name][0]
        assert first is not None
        return first.column


CONFIG_TENSOR = "adapter_config.json"   # the push's first tensor in async mode: the config, as UTF-8 bytes


def pushed(tensors: dict[str, torch.Tensor], config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapter as the weight push carries it (``rlcore.weight_sync.push``, tensors only): its config first, as a
    uint8 tensor of JSON, then its tensors; a push is then self-describing, as a PEFT directory is."""
    yield CONFIG_TENSOR, torch.frombuffer(bytearray(json.dumps(config).encode()), dtype=torch.uint8)
    yield from tensors.items()


def received(stream: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict]:
    """``pushed``'s inverse: (tensors, config), the tensors copied out of the channel's buffers."""
    items = iter(stream)
    name, text = next(items, ("", torch.empty(0)))
    if name != CONFIG_TENSOR:
        raise ValueError(f"an adapters-only weight push starts with {CONFIG_TENSOR!r}, this one with {name!r}: the "
                         "sender and the rollout workers disagree on rollout.lora")
    return {n: t.clone() for n, t in items}, json.loads(bytes(text.numpy()))
