"""Train layout -> rollout layout, per tensor and bucketed.

Every rank of every stage walks the same global plan (all parameters of all pipeline stages, in a fixed order),
cut into buckets of at most ``bucket_bytes`` of full (unsharded) tensors. Per bucket:

1. the owning pipeline stage gathers its TP shards (or, for experts, the EP group's experts) with **one** gather of a
   flat buffer over the group;
2. the model plugin's rules turn the Megatron tensors into HF-named full tensors;
3. with PP > 1, the owning stage sends them to the other stages with **one** broadcast of a flat buffer over the
   pipeline group.

Gathers and broadcasts go through ``rlcore.engine.transport``: shared memory between CPU ranks on one host,
torch.distributed collectives otherwise.

The result is a generator of (HF name, full tensor) that the rollout engine consumes as it loads; the collectives
happen lazily as buckets are pulled, in the same order on every rank. No rank ever holds more than one bucket.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from rlcore.convert import WeightConverter
from rlcore.engine.transport import make_exchange

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class ParamEntry:
    name: str                      # global Megatron name (layer indices counted over the whole model)
    local_shape: tuple[int, ...]   # this TP rank's shard
    dtype: torch.dtype
    tp_sharded: bool
    stage: int                     # owning pipeline stage
    hf: tuple[tuple[str, tuple[int, ...]], ...]   # the HF tensors this parameter becomes, with full shapes
    ep_names: tuple[str, ...] = () # expert parameter under EP: its global name on each expert-parallel rank

    @property
    def full_numel(self) -> int:
        return sum(_numel(s) for _, s in self.hf)

    @property
    def local_bytes(self) -> int:
        return _numel(self.local_shape) * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        return self.full_numel * self.dtype.itemsize


@dataclass
class Bucket:
    stage: int
    entries: list[ParamEntry] = field(default_factory=list)
    full_bytes: int = 0


@dataclass
class SyncCounters:
    collectives: int = 0
    peak_bucket_bytes: int = 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def global_name(model: torch.nn.Module, local_name: str, ep_rank: int | None = None) -> str:
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


def named_weights(model: torch.nn.Module, converter: WeightConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, tensor) of everything the HF checkpoint holds: the parameters, and the buffers that the model
    plugin's rules name: state kept outside the optimizer, such as a MoE router's expert bias (aux-loss-free load
    balancing), which megatron-core registers as a buffer."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if global_name(model, name) in converter.by_megatron:
            yield name, buffer


def is_expert(param: torch.Tensor) -> bool:
    """A parameter of a MoE expert: whole on its rank, never split over TP (expert TP is 1). Megatron marks them
    with allreduce=False only under expert parallelism; ``build_gpt`` tags them at every layout (``rlcore_expert``)."""
    return getattr(param, "rlcore_expert", False) or getattr(param, "allreduce", True) is False


class Resharder:
    """Built once per model; ``stream()`` yields the full HF weights for the rollout engine on every rank."""

    def __init__(self, model: torch.nn.Module, converter: WeightConverter, bucket_bytes: int = 256 << 20,
                 transport: str = "auto"):
        from megatron.core import parallel_state as mpu

        self.model, self.converter, self.bucket_bytes = model, converter, bucket_bytes
        self.tp_size, self.tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.stage = mpu.get_pipeline_model_parallel_rank()
        self.ep_size, self.ep_rank = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank()
        self.local: dict[str, torch.Tensor] = {}
        entries = []
        for local_name, param in named_weights(model, converter):
            expert = self.ep_size > 1 and is_expert(param)
            ep_names = tuple(global_name(model, local_name, r) for r in range(self.ep_size)) if expert else ()
            name = ep_names[0] if expert else global_name(model, local_name)
            self.local[name] = param
            entries.append(self._entry(name, param, ep_names))
        if self.pp_size > 1:   # every stage learns the other stages' parameters once
            per_stage: list = [None] * self.pp_size
            dist.all_gather_object(per_stage, entries, group=self.pp_group)
            entries = [e for stage_entries in per_stage for e in stage_entries]
        self.buckets = self._cut(entries)
        self.counters = SyncCounters()
        own = [b for b in self.buckets if b.stage == self.stage]   # exchange capacities: the largest bucket's piece
        tp_bytes = max([sum(e.local_bytes for e in b.entries if e.tp_sharded) for b in own], default=0)
        ep_bytes = max([sum(e.local_bytes for e in b.entries) for b in own if b.entries[0].ep_names], default=0)
        pp_bytes = max(b.full_bytes for b in self.buckets)
        self.tp = make_exchange(mpu.get_tensor_model_parallel_group(), tp_bytes, transport)
        self.ep = make_exchange(mpu.get_expert_model_parallel_group(), ep_bytes, transport)
        self.pp = make_exchange(self.pp_group, pp_bytes, transport)

    def _entry(self, name: str, param: torch.Tensor, ep_names: tuple[str, ...]) -> ParamEntry:
        sharded = self.tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False)) and not is_expert(param)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        hf = [t for n in (ep_names or (name,)) for t in self.converter.to_hf(n, [meta] * (self.tp_size if sharded
                                                                                             else 1))]
        return ParamEntry(name, tuple(param.shape), param.dtype, sharded, self.stage,
                          tuple((n, tuple(t.shape)) for n, t in hf), ep_names)

    def _cut(self, entries: list[ParamEntry]) -> list[Bucket]:
        """Consecutive parameters of one stage and dtype, up to bucket_bytes (a larger tensor gets its own)."""
        buckets: list[Bucket] = []
        for e in entries:
            last = buckets[-1] if buckets else None
            if (last is None or last.stage != e.stage or last.entries[-1].dtype != e.dtype
                    or bool(last.entries[-1].ep_names) != bool(e.ep_names)
                    or last.full_bytes + e.full_bytes > self.bucket_bytes):
                last = Bucket(e.stage)
                buckets.append(last)
            last.entries.append(e)
            last.full_bytes += e.full_bytes
        return buckets

    # --- the per-bucket pipeline ------------------------------------------------------------------------------
    def _gathered_experts(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """Every expert-parallel rank holds other experts under the same local names: one gather over the EP group,
        then each rank's piece is converted under that rank's global expert names."""
        params = [self.local[e.name].detach() for e in bucket.entries]
        pieces = self.ep.gather(params)
        tensors: list[tuple[str, torch.Tensor]] = []   # in ParamEntry.hf order: parameter-major, then EP rank
        offset = 0
        for p, e in zip(params, bucket.entries):
            for rank in range(self.ep_size):
                shard = p if rank == self.ep_rank else pieces[rank][offset: offset + p.numel()].view(p.shape)
                tensors.extend((n, self.ep.detach(t)) for n, t in self.converter.to_hf(e.ep_names[rank], [shard]))
            offset += p.numel()
        self.ep.release()
        return tensors

    def _gathered(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """On the owning stage: full HF tensors of the bucket (one gather over the TP group)."""
        if bucket.entries[0].ep_names:
            return self._gathered_experts(bucket)
        params = [self.local[e.name].detach() for e in bucket.entries]
        sharded = [p for p, e in zip(params, bucket.entries) if e.tp_sharded]
        shards_of: dict[int, list[torch.Tensor]] = {}
        if sharded:
            pieces = self.tp.gather(sharded)
            offset = 0
            for p in sharded:
                n = p.numel()
                shards_of[id(p)] = [p if r == self.tp_rank else pieces[r][offset: offset + n].view(p.shape)
                                    for r in range(self.tp_size)]
                offset += n
        tensors = [(n, t) for p, e in zip(params, bucket.entries)
                   for n, t in self.converter.to_hf(e.name, shards_of.get(id(p), [p]))]
        if sharded:   # keep nothing that aliases the exchange past its release
            tensors = [(n, self.tp.detach(t)) for n, t in tensors]
            self.tp.release()
        return tensors

    def _broadcast(self, bucket: Bucket, tensors: list[tuple[str, torch.Tensor]] | None):
        """Across pipeline stages: one broadcast of the bucket's HF tensors from the owning stage."""
        names_shapes = [hs for e in bucket.entries for hs in e.hf]
        total = sum(_numel(s) for _, s in names_shapes)
        flat = self.pp.broadcast(None if tensors is None else [t for _, t in tensors], total,
                                 bucket.entries[0].dtype, src=bucket.stage)
        if tensors is None:   # the owning stage keeps its own tensors; the others copy theirs out of the exchange
            tensors, offset = [], 0
            for name, shape in names_shapes:
                n = _numel(shape)
                tensors.append((name, self.pp.detach(flat[offset: offset + n].view(shape))))
                offset += n
        self.pp.release()
        return tensors

    def _bucket_tensors(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        tensors = self._gathered(bucket) if bucket.stage == self.stage else None
        if self.pp_size > 1:
            tensors = self._broadcast(bucket, tensors)
        self.counters.peak_bucket_bytes = max(self.counters.peak_bucket_bytes,
                                              sum(t.numel() * t.element_size() for _, t in tensors))
        return tensors

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every HF tensor, one bucket materialised at a time (peak extra memory: a bucket + its largest
        tensor's conversion). A helper thread prefetching the next bucket was measured on CPU/gloo and gave
        nothing (8.2 s either way at TP2: gloo's loopback bandwidth bounds it), so buckets are produced inline."""
        exchanges = [x for x in (self.tp, self.ep, self.pp) if x is not None]
        calls_before = sum(x.calls for x in exchanges)
        self.counters = SyncCounters()
        for bucket in self.buckets:
            yield from self._bucket_tensors(bucket)
            self.counters.collectives = sum(x.calls for x in exchanges) - calls_before
