"""How the resharder moves a bucket's flat buffers among the ranks of one process group.

Two ways, one interface:

- ``CollectiveExchange``: torch.distributed collectives (NCCL on GPU; gloo across hosts).
- ``SharedMemoryExchange``: for CPU ranks that share a host. gloo moves bytes over loopback TCP at ~160 MB/s
  (measured, docs/benchmarks.md); a memory-mapped segment per rank moves them at memcpy speed. Each rank writes its
  piece into its own segment, a barrier publishes it, the others read it in place, and a second barrier
  (``release``) says everyone has finished reading before the segment is reused.

Pieces returned by ``gather``/``broadcast`` may alias the exchange's memory: they are valid until ``release()``;
``detach`` copies out whatever a caller keeps longer.
"""
from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist


def _flat_into(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    torch.cat([t.reshape(-1) for t in tensors], out=out)
    return out


class CollectiveExchange:
    """torch.distributed collectives; nothing it returns aliases reused memory."""

    def __init__(self, group):
        self.group, self.size = group, dist.get_world_size(group)
        self.calls = 0

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's concatenation of ``tensors`` (same sizes on every rank), as flat pieces in group order."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        out = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(out, flat, group=self.group)
        self.calls += 1
        return list(out.view(self.size, -1))

    def broadcast(self, tensors: list[torch.Tensor] | None, numel: int, dtype: torch.dtype, src: int) -> torch.Tensor:
        """The source's concatenation of ``tensors`` (None elsewhere) on every rank; ``src`` is a group rank."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors is not None else torch.empty(numel, dtype=dtype)
        dist.broadcast(flat, src=dist.get_global_rank(self.group, src), group=self.group)
        self.calls += 1
        return flat

    def release(self) -> None:
        pass

    def detach(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class SharedMemoryExchange:
    """One segment of ``capacity`` bytes per rank in /dev/shm, mapped by every rank of the group. The files are
    unlinked as soon as all ranks have mapped them, so nothing is left behind if a process dies."""

    def __init__(self, group, capacity: int):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.calls = 0
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        paths = [f"/dev/shm/rlcore-sync-{token[0]}-{r}" for r in range(self.size)]
        own = torch.UntypedStorage.from_file(paths[self.rank], shared=True, nbytes=capacity)
        self._barrier()
        storages = [own if r == self.rank else torch.UntypedStorage.from_file(p, shared=True, nbytes=capacity)
                    for r, p in enumerate(paths)]
        self._barrier()
        os.unlink(paths[self.rank])
        self._barrier()   # from here on no segment has a name
        self.segments = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages]
        self._spans = [(s.data_ptr(), s.data_ptr() + capacity) for s in storages]
        self.capacity = capacity

    def _barrier(self) -> None:
        dist.barrier(group=self.group)
        self.calls += 1

    def _view(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes > self.capacity:
            raise ValueError(f"shared-memory exchange: {nbytes} bytes exceed the planned {self.capacity}")
        return self.segments[rank][:nbytes].view(dtype)

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        numel = sum(t.numel() for t in tensors)
        _flat_into(tensors, self._view(self.rank, numel, tensors[0].dtype))
        self._barrier()
        return [self._view(r, numel, tensors[0].dtype) for r in range(self.size)]

    def broadcast(self, tensors: list[torch.Tensor] | None, numel: int, dtype: torch.dtype, src: int) -> torch.Tensor:
        if tensors is not None:
            _flat_into(tensors, self._view(src, numel, dtype))
        self._barrier()
        return self._view(src, numel, dtype)

    def release(self) -> None:
        self._barrier()

    def detach(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        return tensor.clone() if any(lo <= ptr < hi for lo, hi in self._spans) else tensor


def _same_host(group) -> bool:
    with open("/proc/sys/kernel/random/boot_id") as f:
        here = (socket.gethostname(), f.read().strip())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    return all(h == here for h in everyone)


def make_exchange(group, capacity: int, transport: str = "auto"):
    """``auto``: shared memory when the group is on gloo (CPU tensors) and all its ranks share this host, else
    collectives. ``shm`` insists on shared memory; ``collectives`` never uses it (the benchmark's peer).
    None for a group of one rank: there is nothing to exchange."""
    if dist.get_world_size(group) == 1:
        return None
    if transport not in ("auto", "shm", "collectives"):
        raise ValueError(f"weight-sync transport {transport!r}: expected auto, shm or collectives")
    if transport == "collectives" or capacity == 0:
        return CollectiveExchange(group)
    shareable = dist.get_backend(group) == "gloo" and _same_host(group)
    if transport == "shm" and not shareable:
        raise ValueError("weight-sync transport 'shm' needs a gloo group whose ranks all run on one host")
    return SharedMemoryExchange(group, capacity) if shareable else CollectiveExchange(group)
