"""LoRA adapters on megatron-core's tensor-parallel linears: y = base(x) + dropout(x) A^T B^T * alpha / rank, with A
and B sharded like the base weight so that the adapted layer equals the full-matrix LoRA computed unsharded, the base
weight never gathered and its gradient never computed.

An adapter is attached to the linear it adapts (child module ``lora``, parameters ``<linear>.lora.A`` / ``.B``) and
adds its term through a forward hook, rather than replacing the linear by a wrapper module: the base parameters keep
their names, so the weight rules, the weight sync and a base checkpoint see the model they know.

Layouts (tp = tensor-parallel size, r = rank):
- column-parallel base W [out/tp, in] (linear_qkv, linear_fc1, and multi-latent attention's projections, whose down
  projections megatron-core's local spec splits over TP like the up ones, the attention gathering their output): A
  [r, in] replicated, B [out/tp, r] split by rows exactly like W's rows. h = x A^T is complete on every rank; its
  gradient is partial per rank (each rank's B shard), so h passes a TP region that all-reduces that r-wide gradient
  in the backward pass (the base all-reduces its own input gradient). With sequence parallelism x holds this rank's
  sequence chunk: h is computed on the chunk and all-gathered over the sequence (r wide, where the base gathers x,
  hidden wide); the backward pass reduce-scatters, so A's gradient is per chunk and is summed over TP with the
  norms' (``sequence_parallel`` tag, which megatron-core's finalize_model_grads all-reduces).
- row-parallel base W [out, in/tp] (linear_proj, linear_fc2): A [r, in/tp] split by columns like W's columns, B
  [out, r] replicated. x A^T is a partial sum; it is all-reduced (r wide) before B, in the base's own reduction
  pattern: with sequence parallelism reduce-scattered over the sequence, as the base's output is, and then B's
  gradient is per chunk (tagged ``sequence_parallel`` as well).

Fused layouts: B's rows follow W's rows, so the weight rule that splits W into HF projections splits B the same way
(``FusedQKV``: per query group [q heads; k; v]; ``FusedGateUp``: each TP shard [gate_i; up_i]). One fused adapter is
PEFT's per-projection adapters sharing A: q/k/v_proj (gate/up_proj) ``lora_A`` = A, ``lora_B`` = the rule's split of
B; o_proj / down_proj take A split by the rule's columns and B as it is. Initialisation is PEFT's (A kaiming-uniform
with a = sqrt(5) over the full input width, B zero), drawn per layer from the seed and the layer's model-wide name, so
every parallel layout starts from the same adapters.

MoE experts (megatron-core's SequentialMLP: per expert an MLP of a ColumnParallelLinear fc1 and a RowParallelLinear
fc2, marked ``is_expert``, over the expert-tensor-parallel group): ``linear_fc1`` / ``linear_fc2`` on a MoE layer
adapt every routed expert's fc1 / fc2, each with its own A and B, and the shared experts' (a plain MLP on the dense
TP group), as PEFT's gate/up/down_proj target every expert's and the shared expert's projections; the router is
never a target. An expert adapter is named with the expert's model-wide index (its seed, its checkpoint entry, which
megatron-core's SequentialMLP places by that index, so another EP size reads it); its factors are flagged
``allreduce=False`` at every layout, so that Megatron DDP reduces their gradients over the expert-data-parallel group
(megatron-core flags its expert weights so only under EP: at TP2 x EP1 with expert TP 1 the two TP ranks run the
experts on different sequence chunks, are each other's expert-data-parallel peers, and a dense flag would reduce
over data parallelism alone, leaving each rank half the gradient), and never carry the ``sequence_parallel`` tag
(which would all-reduce them over the dense TP group). Expert linears communicate nothing themselves
(``explicit_expert_comm``): the token dispatcher gathers the tokens over the expert-TP group before them and sums the
fc2 outputs' partial sums after. The adapter follows: no TP region around h; its input gradient stays partial like
the base's (the dispatcher sums it); only the replicated factor (column: A, row: B), whose gradient each expert-TP
rank has a part of, is summed over the expert-TP group (``summed_gradient``). rlcore builds expert TP 1, where none
of this communicates.

Dropout: on a column-parallel adapter's input it draws from the default generator, which megatron-core keeps equal
over TP ranks outside sequence parallelism (x is replicated there, and A's gradient must agree on every rank) and
forks per rank inside it (the transformer block runs in the model-parallel RNG then, x being a chunk). A row-parallel
adapter's input is split over TP by features, so it draws in the model-parallel RNG, as core attention's dropout does.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlcore.lora.config import LoRAConfig

class LoRAAdapter(torch.nn.Module):
    """The low-rank term of one tensor-parallel linear, added to its output by a forward hook while ``enabled``."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, cfg: LoRAConfig):
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)
        self.scale = cfg.scale
        self.dropout = cfg.dropout
        self.enabled = True
        # a gated MLP's fc1 (set by attach_lora): each TP rank's rows are [gate_i; up_i], which megatron-core's MLP
        # checkpoints as all gates then all ups (a layout every TP size reads); B's rows follow W's, stored alike
        self.gate_up_rows = False
        self.tp_group = base.tp_group   # an expert's: the expert-tensor-parallel group
        self.tp_size = _size_and_rank(self.tp_group)[0]
        # a MoE expert: the token dispatcher does its TP communication (megatron-core's explicit_expert_comm)
        self.expert = bool(getattr(base, "is_expert", False))
        self.sequence_parallel = bool(base.sequence_parallel) and self.tp_size > 1 and not self.expert
        for p in (self.A, self.B):   # an expert's: Megatron DDP's expert buffers, reduced over expert data parallelism
            setattr(p, "allreduce", not self.expert)
        # first among the linear's hooks: it adds to the linear's own output (MLA's kv down projection has a hook
        # that gathers that output over TP: rlcore.megatron.patches.compat)
        self._hook = base.register_forward_hook(self._add_to_output, with_kwargs=True, prepend=True)

    def _add_to_output(self, base: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.enabled:
            return None
        if kwargs.get("weight") is not None or kwargs.get("runtime_gather_output"):
            raise RuntimeError(f"{type(base).__name__} called with a weight or a gathered output: its LoRA adapter "
                               "adapts only the layer's own weight with its output split over TP")
        out, bias = output
        return out + self.delta(args[0] if args else kwargs["input_"]), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + B A * scale, from this rank's factors alone: B A has W's shard's shape in both
        layouts (column: B [out/tp, r] A [r, in]; row: B [out, r] A [r, in/tp]), so no rank needs another's.
        Summed in float32, returned in W's dtype."""
        return merge(weight, self.A, self.B, self.scale)

    def summed_gradient(self, factor: torch.Tensor) -> torch.Tensor:
        """``factor`` in the forward pass; in the backward pass its gradient summed over the expert-TP group (an
        expert's replicated factor, each expert-TP rank holding part of its gradient)."""
        if not (self.expert and self.tp_size > 1):
            return factor
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(factor, group=self.tp_group)

    def _set_tp_attributes(self, sharded: torch.nn.Parameter, dim: int, replicated: torch.nn.Parameter) -> None:
        """What megatron-core reads off a parameter: the gradient norm counts the sharded one on every TP rank (a
        replicated one on the first only); the replicated one, under sequence parallelism, has a per-chunk gradient
        to be summed over TP."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        setattr(replicated, "sequence_parallel", self.sequence_parallel)
        self.sharded_factor = ("A" if sharded is self.A else "B", dim)

    def checkpoint_entries(self, base_entries: Callable[..., dict]) -> Callable[..., dict]:
        """The adapted linear's ``sharded_state_dict``: the base's, whose entries for the adapter (its child's
        parameters, which the base takes for replicated ones) get the TP-sharded factor declared as sharded along
        its TP axis, so that a distributed checkpoint keeps every TP rank's part and a resume reshards it."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
            entries = base_entries(prefix, sharded_offsets, metadata)
            name, axis = self.sharded_factor
            key = f"{prefix}lora.{name}"
            groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]} if metadata else {}
            entries[key] = make_tp_sharded_tensor_for_checkpoint(getattr(self, name), key, axis,
                                                                 prepend_offsets=sharded_offsets, **groups)
            if self.gate_up_rows:   # stored as W is: the gate halves of all TP ranks, then the up halves
                entries[key] = apply_swiglu_sharded_factory(entries[key], sharded_offsets,
                                                            (metadata or {}).get("singleton_local_shards", False))
            return entries

        return sharded_state_dict


class ColumnLoRA(LoRAAdapter):
    """For a ColumnParallelLinear: A [r, in] replicated, B [out/tp, r] split like W's rows."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, cfg: LoRAConfig):
        super().__init__(base, a, b, cfg)
        self._set_tp_attributes(self.B, 0, self.A)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        h = torch.matmul(x, self.summed_gradient(self.A).t())
        if self.expert:
            pass                     # x is the dispatched tokens, whole on every expert-TP rank
        elif self.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.tp_size > 1:
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.matmul(h, self.B.t()) * self.scale


class RowLoRA(LoRAAdapter):
    """For a RowParallelLinear: A [r, in/tp] split like W's columns, B [out, r] replicated."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, cfg: LoRAConfig):
        super().__init__(base, a, b, cfg)
        self._set_tp_attributes(self.A, 1, self.B)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        if self.dropout and self.training:
            with get_cuda_rng_tracker().fork():
                x = torch.nn.functional.dropout(x, self.dropout)
        partial = torch.matmul(x, self.A.t())
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        elif self.tp_size > 1 and not self.expert:   # an expert's partial output is summed by the dispatcher
            h = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        else:
            h = partial
        return torch.matmul(h, self.summed_gradient(self.B).t()) * self.scale


@torch.no_grad()
def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + B A * scale, summed in float32, in W's dtype."""
    delta = torch.matmul(b.detach().float(), a.detach().float()) * scale
    return (weight.detach().float() + delta).to(weight.dtype)


def attach_lora(base: Any, cfg: LoRAConfig, name: str) -> LoRAAdapter:
    """Attach an adapter (PEFT's initialisation, seeded by ``cfg.seed`` and ``name``, the layer's model-wide name) to
    a megatron-core ColumnParallelLinear or RowParallelLinear as its child ``lora``; returns it."""
    kind = adapter_kind(base, name)
    weight = base.weight
    tp_size, tp_rank = _size_and_rank(base.tp_group)
    generator = torch.Generator().manual_seed(cfg.seed * 2**32 + zlib.crc32(name.encode()))
    a = torch.empty(cfg.rank, weight.shape[1] * (1 if kind is ColumnLoRA else tp_size))   # the full input width
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)                # PEFT's: bound 1/sqrt(in)
    if kind is RowLoRA:
        a = a.chunk(tp_size, dim=1)[tp_rank].contiguous()
    b = torch.zeros(weight.shape[0], cfg.rank)   # [out/tp, r] for a column-parallel W, [out, r] for a row one
    adapter = kind(base, a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype), cfg)
    adapter.gate_up_rows = name.endswith(".linear_fc1") and bool(getattr(base.config, "gated_linear_unit", False))
    base.lora = adapter
    base.sharded_state_dict = adapter.checkpoint_entries(base.sharded_state_dict)
    return adapter


def adapter_kind(base: Any, name: str) -> type[LoRAAdapter]:
    """The adapter for this linear; a ValueError naming it where there is none (yet). The seam for the layers to
    come: routed experts (grouped or sequential), TransformerEngine's linears (MLA's duplicated down projections)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(getattr(base, "lora", None), LoRAAdapter):
        raise ValueError(f"LoRA on {name}: the linear already has an adapter")
    if isinstance(base, ColumnParallelLinear):
        if base.gather_output:
            raise ValueError(f"LoRA on {name}: a ColumnParallelLinear that gathers its output is not a decoder "
                             "linear")
        return ColumnLoRA
    if isinstance(base, RowParallelLinear):
        return RowLoRA
    raise ValueError(f"LoRA adapts megatron-core's ColumnParallelLinear and RowParallelLinear; {name} is a "
                     f"{type(base).__name__} (TransformerEngine's linears are not supported yet)")


def _size_and_rank(group: Any) -> tuple[int, int]:
    return (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)


def add_lora(model: torch.nn.Module, cfg: LoRAConfig) -> list[torch.nn.Parameter]:
    """Freeze every parameter of ``model`` (a GPTModel, this rank's part) and attach adapters to the linears named
    in ``cfg.target_modules``; returns the adapter parameters, the only trainable ones. A target this model lacks,
    or a linear that cannot be adapted yet, is refused before the model is changed."""
    from rlcore.megatron.names import global_name

    targets = [(global_name(model, f"{name}.weight")[: -len(".weight")], module)
               for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in cfg.target_modules]
    found = {name.rsplit(".", 1)[-1] for name, _ in targets}
    missing = [t for t in cfg.target_modules if t not in found]
    if missing:
        raise ValueError(f"LoRA target_modules {missing} match no linear of this model (it has "
                         f"{', '.join(sorted(found)) or 'none of the targets'}); remove them")
    for name, module in targets:
        adapter_kind(module, name)
    model.requires_grad_(False)
    params: list[torch.nn.Parameter] = []
    for name, module in targets:
        adapter = attach_lora(module, cfg, name)
        params += [adapter.A, adapter.B]
    return params


def adapters(model: torch.nn.Module) -> Iterator[LoRAAdapter]:
    return (m for m in model.modules() if isinstance(m, LoRAAdapter))


@contextmanager
def adapters_enabled(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, ``model``'s adapters add their term (True) or not (False): with False the model is the
    base model exactly (the reference policy, without a second copy of the weights). Restores the previous state."""
    found = list(adapters(model))
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = enabled
    try:
        yield
    finally:
        for a, state in zip(found, before):
            a.enabled = state
