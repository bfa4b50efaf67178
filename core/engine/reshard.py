"""Train layout -> rollout layout, per tensor and bucketed.

Every rank of every stage walks the same global plan (all parameters of all pipeline stages, in a fixed order),
cut into buckets of at most ``bucket_bytes`` of full (unsharded) tensors. Per bucket:

1. the owning pipeline stage gathers its TP shards with **one** all-gather of a flat buffer over the TP group;
2. the model plugin's rules turn the Megatron tensors into HF-named full tensors;
3. with PP > 1, the owning stage sends them to the other stages with **one** broadcast of a flat buffer over the
   pipeline group.

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

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ParamEntry:
    name: str                      # global Megatron name (layer indices counted over the whole model)
    local_shape: tuple[int, ...]   # this TP rank's shard
    dtype: torch.dtype
    tp_sharded: bool
    stage: int                     # owning pipeline stage
    hf: tuple[tuple[str, tuple[int, ...]], ...]   # the HF tensors this parameter becomes, with full shapes

    @property
    def full_bytes(self) -> int:
        return sum(_numel(s) for _, s in self.hf) * torch.empty((), dtype=self.dtype).element_size()


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


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """Megatron numbers decoder layers per pipeline stage; the rules use the model-wide index."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    layer = model.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{local_name[m.end():]}"


class Resharder:
    """Built once per model; ``stream()`` yields the full HF weights for the rollout engine on every rank."""

    def __init__(self, model: torch.nn.Module, converter: WeightConverter, bucket_bytes: int = 256 << 20):
        from megatron.core import parallel_state as mpu

        self.model, self.converter, self.bucket_bytes = model, converter, bucket_bytes
        self.tp_group, self.tp_size = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()
        self.pp_group, self.pp_size = mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_world_size()
        self.stage = mpu.get_pipeline_model_parallel_rank()
        self.local = {global_name(model, n): p for n, p in model.named_parameters()}
        entries = [self._entry(n, p) for n, p in self.local.items()]
        if self.pp_size > 1:   # every stage learns the other stages' parameters once
            per_stage: list = [None] * self.pp_size
            dist.all_gather_object(per_stage, entries, group=self.pp_group)
            entries = [e for stage_entries in per_stage for e in stage_entries]
        self.buckets = self._cut(entries)
        self.counters = SyncCounters()

    def _entry(self, name: str, param: torch.Tensor) -> ParamEntry:
        sharded = self.tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False))
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        hf = self.converter.to_hf(name, [meta] * (self.tp_size if sharded else 1))
        return ParamEntry(name, tuple(param.shape), param.dtype, sharded, self.stage,
                          tuple((n, tuple(t.shape)) for n, t in hf))

    def _cut(self, entries: list[ParamEntry]) -> list[Bucket]:
        """Consecutive parameters of one stage and dtype, up to bucket_bytes (a larger tensor gets its own)."""
        buckets: list[Bucket] = []
        for e in entries:
            last = buckets[-1] if buckets else None
            if (last is None or last.stage != e.stage or last.entries[-1].dtype != e.dtype
                    or last.full_bytes + e.full_bytes > self.bucket_bytes):
                last = Bucket(e.stage)
                buckets.append(last)
            last.entries.append(e)
            last.full_bytes += e.full_bytes
        return buckets

    # --- the per-bucket pipeline ------------------------------------------------------------------------------
    def _gathered(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """On the owning stage: full HF tensors of the bucket (one TP all-gather)."""
        params = [self.local[e.name].detach() for e in bucket.entries]
        sharded = [p for p, e in zip(params, bucket.entries) if e.tp_sharded]
        shards_of: dict[int, list[torch.Tensor]] = {}
        if sharded:
            flat = torch.cat([p.reshape(-1) for p in sharded])
            out = torch.empty(self.tp_size * flat.numel(), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(out, flat, group=self.tp_group)
            self.counters.collectives += 1
            per_rank = out.view(self.tp_size, -1)
            offset = 0
            for p in sharded:
                n = p.numel()
                shards_of[id(p)] = [per_rank[r, offset: offset + n].view(p.shape) for r in range(self.tp_size)]
                offset += n
        tensors: list[tuple[str, torch.Tensor]] = []
        for p, e in zip(params, bucket.entries):
            tensors.extend(self.converter.to_hf(e.name, shards_of.get(id(p), [p])))
        return tensors

    def _broadcast(self, bucket: Bucket, tensors: list[tuple[str, torch.Tensor]] | None):
        """Across pipeline stages: one broadcast of the bucket's HF tensors from the owning stage."""
        names_shapes = [hs for e in bucket.entries for hs in e.hf]
        dtype = bucket.entries[0].dtype
        total = sum(_numel(s) for _, s in names_shapes)
        if tensors is not None:
            flat = torch.cat([t.reshape(-1) for _, t in tensors])
        else:
            flat = torch.empty(total, dtype=dtype)
        src = dist.get_global_rank(self.pp_group, bucket.stage)
        dist.broadcast(flat, src=src, group=self.pp_group)
        self.counters.collectives += 1
        out, offset = [], 0
        for name, shape in names_shapes:
            n = _numel(shape)
            out.append((name, flat[offset: offset + n].view(shape)))
            offset += n
        return out

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.counters = SyncCounters()
        for bucket in self.buckets:
            tensors = self._gathered(bucket) if bucket.stage == self.stage else None
            if self.pp_size > 1:
                tensors = self._broadcast(bucket, tensors)
            self.counters.peak_bucket_bytes = max(self.counters.peak_bucket_bytes,
                                                  sum(t.numel() * t.element_size() for _, t in tensors))
            yield from tensors
