"""How the resharder (``rlcore.megatron.reshard``) assembles a bucket's full Megatron tensors from the pieces that
ranks hold; the push to separate rollout workers (``rlcore.weight_sync.push``) maps its shared memory the same way.

A bucket is one flat buffer holding full HF tensors. Every piece of it (a TP shard, a pipeline stage's whole tensor,
an expert-parallel rank's expert) is supplied by exactly one *writer* rank, the lowest rank holding it.
``assemble(numel, dtype, regions, own)`` returns the buffer: ``regions[w]`` lists where writer ``w``'s pieces go
(each a function from the buffer to the views of it that one piece fills), ``own`` holds this rank's pieces, in the
same order, each as the source views matching those.

- ``SharedMemoryExchange``: for CPU ranks on one host. gloo moves bytes over loopback TCP at ~160 MB/s (measured,
  docs/benchmarks.md); here every rank maps the same two buffers ("slots") in /dev/shm and writes its pieces
  straight into place, so a bucket costs one write of each rank's own bytes and nothing is copied out afterwards:
  the returned tensor *is* the slot. Buckets alternate between the slots. Before a slot is reused, every rank checks
  that nothing still references it (a rollout engine may keep a layer's tensors until the layer is complete, or
  until the end of the load); if anything does, the group maps a fresh slot and the old one lives on until its last
  reference dies. Correct for any consumer; fast for one that lets go.
- ``CollectiveExchange``: torch.distributed broadcasts, one per writer and bucket (NCCL on GPU; gloo across hosts).
  Every call returns a fresh buffer.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Callable, cast

import torch
import torch.distributed as dist

Region = Callable[[torch.Tensor], list[torch.Tensor]]


class CollectiveExchange:
    def __init__(self, group, device: torch.device):
        self.group, self.rank, self.device = group, dist.get_rank(group), device
        self.calls = 0

    def assemble(self, numel: int, dtype: torch.dtype, regions: dict[int, list[Region]],
                 own: list[list[torch.Tensor]]) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=self.device)
        for writer in sorted(regions):
            places = [view for place in regions[writer] for view in place(buffer)]
            if writer == self.rank:
                flat = torch.cat([t.reshape(-1) for piece in own for t in piece])
            else:
                flat = torch.empty(sum(p.numel() for p in places), dtype=dtype, device=self.device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, writer), group=self.group)
            self.calls += 1
            offset = 0
            for place in places:
                place.copy_(flat[offset: offset + place.numel()].view(place.shape))
                offset += place.numel()
        return buffer


class SharedMemoryExchange:
    """Two slots of ``capacity`` bytes in /dev/shm, mapped by every rank of the group. A slot's file is unlinked as
    soon as all ranks have mapped it, so nothing is left behind if a process dies."""

    def __init__(self, group, capacity: int):
        self.group, self.rank = group, dist.get_rank(group)
        self.capacity, self.calls, self.remapped = capacity, 0, 0
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        self._prefix, self._maps = f"/dev/shm/rlcore-sync-{token[0]}", 0
        self.slots = [self._map_slot(), self._map_slot()]
        self._turn = 0

    def _barrier(self) -> None:
        dist.barrier(group=self.group)
        self.calls += 1

    def _map_slot(self) -> torch.Tensor:
        """Collective: group rank 0 creates the file, everyone maps it, rank 0 unlinks it; on return it has no name."""
        path = f"{self._prefix}-{self._maps}"
        self._maps += 1
        return map_among(path, self.capacity, self.rank == 0, self._barrier)

    def _next_slot(self) -> torch.Tensor:
        """The slot the bucket before last used, once no rank references it any more (else a fresh one)."""
        index = self._turn % len(self.slots)
        self._turn += 1
        held = torch.tensor([int(held_elsewhere(self.slots[index]))])
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self.group)
        self.calls += 1
        if held.item():
            self.slots[index] = self._map_slot()
            self.remapped += 1
        return self.slots[index]

    def assemble(self, numel: int, dtype: torch.dtype, regions: dict[int, list[Region]],
                 own: list[list[torch.Tensor]]) -> torch.Tensor:
        if numel * dtype.itemsize > self.capacity:
            raise ValueError(f"shared-memory exchange: {numel * dtype.itemsize} bytes exceed the planned "
                             f"{self.capacity}")
        buffer = self._next_slot()[: numel * dtype.itemsize].view(dtype)
        for place, sources in zip(regions.get(self.rank, []), own):
            for view, source in zip(place(buffer), sources, strict=True):
                view.copy_(source)
        self._barrier()   # every piece is in place
        return buffer


def _map_file(path: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the file ``path`` in /dev/shm (created if missing), mapped shared: what one process
    writes into it, every process that maps the same file sees."""
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))


def map_among(path: str, nbytes: int, creator: bool, barrier: Callable[[], None]) -> torch.Tensor:
    """Collective over the processes that ``barrier`` synchronises: the creator makes the file, everyone maps it,
    the creator unlinks it; on return it has no name, so it is freed with its last mapping even if a process dies."""
    if creator:
        slot = _map_file(path, nbytes)
    barrier()
    if not creator:
        slot = _map_file(path, nbytes)
    barrier()
    if creator:
        os.unlink(path)
    barrier()
    return slot


def held_elsewhere(slot: torch.Tensor) -> bool:
    """Whether anything but ``slot`` itself references its memory (a consumer's view of it): more references to
    the storage than the slot tensor and the temporary storage object made here to count them."""
    return torch._C._storage_Use_Count(slot.untyped_storage()._cdata) > 2


def host_id() -> tuple[str, str]:
    """This machine, as processes that may share memory compare it: host name and boot id (containers on one
    host share /dev/shm only if both match)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return socket.gethostname(), f.read().strip()


def _same_host(group) -> bool:
    here = host_id()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    return all(h == here for h in everyone)


def make_exchange(group, capacity: int, transport: str = "auto", device: torch.device = torch.device("cpu")):
    """``auto``: shared memory when the group is on gloo (CPU tensors) and all its ranks share this host, else
    collectives. ``shm`` insists on shared memory; ``collectives`` never uses it (the benchmark's peer).
    None when there is nothing to exchange (``capacity`` 0: every rank holds every tensor whole)."""
    if transport not in ("auto", "shm", "collectives"):
        raise ValueError(f"weight-sync transport {transport!r}: expected auto, shm or collectives")
    if capacity == 0:
        return None
    if transport == "collectives":
        return CollectiveExchange(group, device)
    shareable = dist.get_backend(group) == "gloo" and _same_host(group)
    if transport == "shm" and not shareable:
        raise ValueError("weight-sync transport 'shm' needs a gloo group whose ranks all run on one host")
    return SharedMemoryExchange(group, capacity) if shareable else CollectiveExchange(group, device)
