"""Train layout -> rollout layout, per tensor and bucketed.

Every rank walks the same global plan: every parameter of the whole model (all pipeline stages, all experts), as a
full (unsharded) tensor, cut into buckets of at most ``bucket_bytes``; the stages' tensors interleave, so that
every stage supplies part of every bucket. Each piece of a tensor (a TP shard; a stage's or an expert-parallel
rank's whole tensor) has one *writer*, the lowest global rank holding it. Per bucket:

1. the exchange assembles the bucket's full HF tensors in one flat buffer, each writer copying its pieces straight
   into HF layout through the model plugin's rules (``shard_to_hf``) — written in place into shared memory by ranks
   on one host, one broadcast per writer otherwise (``rlcore.megatron.exchange``); the engine gets views of it;
2. tensors that every rank holds whole (everything at TP1/PP1, norms replicated over TP) are not exchanged: the
   rules convert them locally (``to_hf``: views where the layouts allow).

The result is a generator of (HF name, full tensor) that the rollout engine consumes as it loads; the exchange
happens lazily as buckets are pulled, in the same order on every rank. No rank ever holds more than a bucket of
exchanged tensors (two with shared memory, whose slots alternate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from rlcore.convert import WeightConverter
from rlcore.hf_checkpoint import TensorSpec
from rlcore.megatron.names import global_name, is_expert, named_weights
from rlcore.megatron.exchange import make_exchange

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from rlcore.lora.layers import LoRAAdapter


@dataclass(frozen=True)
class ParamEntry:
    name: str                      # global Megatron name (layer and expert indices counted over the whole model)
    shard_shape: tuple[int, ...]   # one rank's shard (the whole tensor when tp_dim is None)
    dtype: torch.dtype
    tp_dim: int | None             # split into len(writers) TP shards along this dimension; None: whole
    writers: tuple[int, ...]       # the global rank that supplies shard i
    everywhere: bool               # every rank holds it whole: converted from the local copy, never exchanged
    hf: tuple[tuple[str, tuple[int, ...]], ...]   # the HF tensors it becomes, with their shapes

    @property
    def full_numel(self) -> int:
        return sum(_numel(s) for _, s in self.hf)

    @property
    def full_bytes(self) -> int:
        return self.full_numel * self.dtype.itemsize


@dataclass
class Bucket:
    entries: list[ParamEntry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)   # each exchanged entry's HF tensors' place in the buffer
    numel: int = 0                                      # of the exchanged entries' HF tensors
    full_bytes: int = 0                                 # of all the HF tensors

    @property
    def dtype(self) -> torch.dtype:
        return self.entries[0].dtype


@dataclass
class SyncCounters:
    collectives: int = 0
    peak_bucket_bytes: int = 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def adapted_weights(model: GPTModel) -> dict[str, LoRAAdapter]:
    """Global name of each weight a LoRA adapter adapts -> its adapter (``rlcore.lora.layers``)."""
    from rlcore.lora.layers import LoRAAdapter

    return {global_name(model, f"{name}.weight"): module.lora for name, module in model.named_modules()
            if isinstance(getattr(module, "lora", None), LoRAAdapter)}


@dataclass(frozen=True)
class _Held:
    """One tensor as one rank holds it: shard ``index`` of ``count``."""
    name: str
    index: int
    count: int
    tp_dim: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype


class Resharder:
    """Built once per model (collective over the default group); ``stream()`` yields the full HF weights for the
    rollout engine on every rank."""

    def __init__(self, model: GPTModel, converter: WeightConverter, bucket_bytes: int = 256 << 20,
                 transport: str = "auto"):
        from megatron.core import parallel_state as mpu

        self.converter, self.bucket_bytes = converter, bucket_bytes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.local: dict[str, torch.Tensor] = {}
        self.adapters = adapted_weights(model)   # LoRA: these weights are sent as W + B A * scale
        held = []
        for local_name, param in named_weights(model, converter):
            name = global_name(model, local_name)
            self.local[name] = param
            sharded = tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False)) and not is_expert(param)
            held.append(_Held(name, tp_rank if sharded else 0, tp_size if sharded else 1,
                              self._tp_dim(name, param) if sharded else None, tuple(param.shape), param.dtype))
        everyone: list = [None] * self.world   # every rank learns what every other rank holds, once
        dist.all_gather_object(everyone, (mpu.get_pipeline_model_parallel_rank(), held))
        self.buckets = self._cut(self._plan(everyone))
        self.counters = SyncCounters()
        capacity = max((b.numel * b.dtype.itemsize for b in self.buckets), default=0)
        self.exchange = make_exchange(dist.group.WORLD, capacity, transport, next(model.parameters()).device)

    def _tp_dim(self, name: str, param: torch.Tensor) -> int:
        dim = getattr(self.converter.rule(name), "tp_dim", None)
        if dim is None or dim != getattr(param, "partition_dim", dim):
            raise ValueError(f"Megatron splits {name!r} over tensor parallelism along dimension "
                             f"{getattr(param, 'partition_dim', '?')}, but the model plugin's weight rule for it "
                             f"says tp_dim={dim}: fix the rule's tp_dim")
        return dim

    def _plan(self, everyone: list) -> list[ParamEntry]:
        """Position by position over all ranks (stage by stage within a position): the experts of one layer, held
        by different expert-parallel ranks at the same local position, stay together; and the pipeline stages'
        tensors interleave, so every stage writes into every bucket instead of the others waiting while one
        writes its buckets alone."""
        holders: dict[tuple[str, int], list[int]] = {}
        first: dict[str, _Held] = {}
        ranks = sorted(range(self.world), key=lambda r: everyone[r][0])
        for position in range(max(len(held) for _, held in everyone)):
            for r in ranks:
                if position < len(everyone[r][1]):
                    h = everyone[r][1][position]
                    first.setdefault(h.name, h)
                    holders.setdefault((h.name, h.index), []).append(r)
        entries = []
        for name, h in first.items():
            shape = list(h.shape)
            if h.tp_dim is not None:
                shape[h.tp_dim] *= h.count
            writers = tuple(min(holders[(name, i)]) for i in range(h.count))
            everywhere = h.count == 1 and len(holders[(name, 0)]) == self.world
            meta = torch.empty(shape, dtype=h.dtype, device="meta")
            hf = tuple((n, tuple(t.shape)) for n, t in self.converter.to_hf(name, [meta]))
            entries.append(ParamEntry(name, h.shape, h.dtype, h.tp_dim, writers, everywhere, hf))
        return entries

    def _cut(self, entries: list[ParamEntry]) -> list[Bucket]:
        """Consecutive tensors of one dtype, up to bucket_bytes of HF tensors (a larger tensor gets its own)."""
        buckets: list[Bucket] = []
        for e in entries:
            last = buckets[-1] if buckets else None
            if last is None or last.dtype != e.dtype or last.full_bytes + e.full_bytes > self.bucket_bytes:
                last = Bucket()
                buckets.append(last)
            last.entries.append(e)
            last.offsets.append(last.numel)
            last.full_bytes += e.full_bytes
            if not e.everywhere:
                last.numel += e.full_numel
        return buckets

    # --- the per-bucket pipeline ------------------------------------------------------------------------------
    def _hf_views(self, buffer: torch.Tensor, entry: ParamEntry, offset: int) -> list[torch.Tensor]:
        views = []
        for _, shape in entry.hf:
            views.append(buffer[offset: offset + _numel(shape)].view(shape))
            offset += _numel(shape)
        return views

    def _pieces(self, buffer: torch.Tensor, entry: ParamEntry, offset: int, index: int, shard: torch.Tensor):
        """(view of the bucket buffer, view of the shard) pairs: where shard ``index`` of ``entry`` lands."""
        return self.converter.rule(entry.name).shard_to_hf(shard, self._hf_views(buffer, entry, offset), index,
                                                           len(entry.writers), self.converter.layout)

    def _assembled(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's exchanged HF tensors in one buffer. Destinations are worked out against a meta shard (any
        writer's), sources against this rank's own shard and a meta stand-in for the buffer."""
        if not bucket.numel:                      # every tensor of the bucket is held whole everywhere
            return torch.empty(0, dtype=bucket.dtype)
        regions: dict[int, list] = {}
        own = []
        stand_in = torch.empty(bucket.numel, dtype=bucket.dtype, device="meta")
        for e, offset in zip(bucket.entries, bucket.offsets):
            if e.everywhere:
                continue
            meta = torch.empty(e.shard_shape, dtype=e.dtype, device="meta")
            for index, writer in enumerate(e.writers):
                regions.setdefault(writer, []).append(partial(self._destinations, entry=e, offset=offset,
                                                              index=index, meta=meta))
                if writer == self.rank:
                    shard = self._current(e.name)
                    own.append([source for _, source in self._pieces(stand_in, e, offset, index, shard)])
        return self.exchange.assemble(bucket.numel, bucket.dtype, regions, own)

    def _destinations(self, buffer: torch.Tensor, entry: ParamEntry, offset: int, index: int,
                      meta: torch.Tensor) -> list[torch.Tensor]:
        return [view for view, _ in self._pieces(buffer, entry, offset, index, meta)]

    def _current(self, name: str) -> torch.Tensor:
        """This rank's piece of ``name`` as the engine is to see it: an adapted weight merged with its adapter, each
        rank merging its own shard."""
        adapter = self.adapters.get(name)
        return self.local[name].detach() if adapter is None else adapter.merged(self.local[name])

    def _bucket_tensors(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        buffer = self._assembled(bucket)
        tensors = []
        for e, offset in zip(bucket.entries, bucket.offsets):
            if e.everywhere:
                tensors.extend(self.converter.to_hf(e.name, [self._current(e.name)]))
            else:
                tensors.extend(zip((n for n, _ in e.hf), self._hf_views(buffer, e, offset)))
        self.counters.peak_bucket_bytes = max(self.counters.peak_bucket_bytes,
                                              sum(t.numel() * t.element_size() for _, t in tensors))
        return tensors

    def hf_specs(self) -> list[TensorSpec]:
        """The HF tensors ``stream`` yields, in order, with their shapes and dtypes."""
        return [TensorSpec(name, shape, e.dtype) for b in self.buckets for e in b.entries for name, shape in e.hf]

    def write_hf(self, hf_config: dict, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Collective; global rank 0 writes the HF checkpoint (``save_hf``) as the weights stream by, one bucket in
        memory."""
        from rlcore.megatron.model import save_hf

        if dist.get_rank() == 0:
            save_hf(self.stream(), self.hf_specs(), hf_config, directory, max_shard_bytes)
        else:
            for _ in self.stream():
                pass

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every HF tensor, one bucket assembled at a time. A yielded tensor may alias the exchange's memory;
        the exchange never overwrites memory that something still references."""
        calls_before = self.exchange.calls if self.exchange else 0
        self.counters = SyncCounters()
        for bucket in self.buckets:
            yield from self._bucket_tensors(bucket)
            self.counters.collectives = (self.exchange.calls if self.exchange else 0) - calls_before
