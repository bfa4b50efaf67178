"""The weight push (async mode): the trainer's full HF tensors, after an update, from the trainer's global rank 0 to
R rollout-worker processes, each of which hands them to its engine as an iterator.

Both sides already live in a torch.distributed default world of their own (Megatron's; maybe an engine's), so the
channel is a group of its own that torch.distributed never registers: the sender (channel rank 0) hosts a TCPStore at
``address``, receivers 1..R connect to it, and a ProcessGroupGloo made from that store carries the messages through
its own collectives. Constructing either side connects nothing (the sender only binds the store's port), so the
driver may construct them in any order; the first ``send`` and ``receive`` meet. Every wait is bounded by
``timeout_s``: a receiver whose sender died raises one line naming it and the version (TRL #6796: weight transfer
hanging silently).

A push is the sender's announcement of its version, its buckets, then its end, which the receivers answer once their
engines have taken the last bucket; the sender does not wait for that answer until its next push (``landed``), so
the trainer goes on while the engines load. A bucket packs whole tensors into a flat buffer of at most ``capacity``
bytes (a larger tensor gets one of its own), each at a 64-byte aligned offset so that any dtype can view it in place;
a JSON header (names, dtypes, shapes, offsets) follows it. Transports:
- ``shm``, one host: two slots in /dev/shm mapped by every rank, as in ``transport.SharedMemoryExchange``. The sender
  copies the stream's tensors straight into a slot (keeping no reference to them, so the trainer's own exchange can
  reuse its slots), the receivers hand out views of it (no copy). A slot that any receiver's consumer still
  references (an engine holds a layer's tensors until the layer is complete) is replaced by a fresh one, never
  overwritten.
- ``collectives``: a gloo broadcast of each bucket into a fresh buffer on every receiver (across hosts). NCCL on GPU
  would be this transport over a ProcessGroupNCCL and device buffers: ``_connect`` and ``_buffer`` are the seam.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from rlcore.megatron.exchange import held_elsewhere, host_id, map_among

ALIGN = 64
PUSH, BUCKET, END = 1, 2, 3     # what an announcement says


@dataclass
class PushStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int


class WeightPushError(RuntimeError):
    """A peer died, went silent past the timeout, or broke the protocol: the channel is unusable afterwards."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _resolve(peers: list[list[str]]) -> dict:
    """The transport every rank will use, from each one's [host name, boot id, wish]: shared memory when all share
    this host and nobody asked for collectives (``transport.make_exchange``'s rule)."""
    wishes = {wish for *_, wish in peers} - {"auto"}
    one_host = all(p[:2] == peers[0][:2] for p in peers)
    if len(wishes) > 1:
        return {"error": f"the channel's ranks asked for different transports: {sorted(wishes)}"}
    if wishes == {"shm"} and not one_host:
        return {"error": "transport 'shm' needs every rank of the channel on one host; use auto or collectives"}
    shm = one_host and wishes != {"collectives"}
    return {"transport": "shm" if shm else "collectives", "prefix": f"/dev/shm/rlcore-push-{uuid.uuid4().hex}"}


class _Channel:
    def __init__(self, address: str, rank: int, receivers: int, capacity: int, transport: str, timeout_s: float):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"weight push address {address!r}: expected host:port (the driver's node IP and a "
                             "port from rlcore.launch.free_port())")
        if transport not in ("auto", "shm", "collectives"):
            raise ValueError(f"weight push transport {transport!r}: expected auto, shm or collectives")
        if not 0 <= rank <= receivers or capacity <= 0:
            raise ValueError(f"weight push rank {rank} of {receivers} receivers, capacity {capacity}: expected a "
                             "rank in 1..receivers (0 is the sender) and a positive capacity in bytes")
        self.address, self.host, self.port, self.rank, self.size = address, host, int(port), rank, receivers + 1
        self.capacity, self.wish, self.timeout = capacity, transport, timedelta(seconds=timeout_s)
        self.store = (dist.TCPStore(host, self.port, self.size, is_master=True, timeout=self.timeout,
                                    wait_for_workers=False) if rank == 0 else None)
        self.pg: Any = None     # a ProcessGroupGloo (torch's stubs give its collectives to ProcessGroup only)
        self.slots: list[torch.Tensor] = []
        self.transport, self.turn, self.maps, self.remapped = "", 0, 0, 0
        self.staging: torch.Tensor | None = None     # collectives: the sender's bucket buffer, reused
        self.version, self.pushing = -1, False
        self.ending: tuple[Any, torch.Tensor] | None = None   # the sender's last END, until the receivers answer it

    def _connect(self) -> None:
        if self.pg is not None:
            return
        store = self.store = self.store or dist.TCPStore(self.host, self.port, self.size, timeout=self.timeout)
        store.set(f"rank{self.rank}", json.dumps([*host_id(), self.wish]))
        if self.rank == 0:
            store.set("plan", json.dumps(_resolve([json.loads(store.get(f"rank{r}")) for r in range(self.size)])))
        plan = json.loads(store.get("plan"))
        if "error" in plan:
            raise ValueError(f"weight push at {self.address}: {plan['error']}")
        self.transport, self.prefix = plan["transport"], plan["prefix"]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), self.rank, self.size, self.timeout)
        if self.transport == "shm":
            self.slots = [self._map(self.capacity), self._map(self.capacity)]

    @contextmanager
    def _failing(self):
        """Any failure of the channel as one line: who, which push, and the cause's first line."""
        try:
            yield
        except WeightPushError:
            raise
        except RuntimeError as e:     # gloo's and the store's errors (DistError) are RuntimeErrors
            self.close()              # unusable now; closing it tells the peers still waiting on this rank at once
            raise WeightPushError(f"{self._push()}: {self._peer()} failed, left or stayed silent past "
                                  f"{self.timeout.total_seconds():g} s: {_cause(e)}") from e

    def _push(self) -> str:
        v = self.version
        return f"weight push v{v}" if self.pushing else f"weight push after v{v}" if v >= 0 else "first weight push"

    def _peer(self) -> str:
        return (f"the sender (channel rank 0 at {self.address})" if self.rank else
                f"the receivers (channel ranks 1..{self.size - 1} at {self.address})")

    def _wait(self, work) -> None:
        work.wait(self.timeout)

    def _barrier(self) -> None:
        self._wait(self.pg.barrier())

    def _map(self, nbytes: int) -> torch.Tensor:
        self.maps += 1
        return map_among(f"{self.prefix}-{self.maps}", nbytes, self.rank == 0, self._barrier)

    def _announce(self, kind: int = 0, oneoff: int = 0) -> tuple[int, int, int, bool]:
        """One round trip carries the sender's word (kind, version, bytes of a bucket too big for a slot) and the
        receivers' slot check (does anyone still reference the slot a regular bucket would use next)."""
        if self.rank == 0:
            message = torch.tensor([kind, self.version, oneoff, 0])
        else:
            held = self.transport == "shm" and held_elsewhere(self.slots[self.turn % 2])
            message = torch.tensor([0, 0, 0, int(held)])
        self._wait(self.pg.allreduce(message, dist.ReduceOp.MAX))
        kind, version, oneoff, held = message.tolist()
        return kind, version, oneoff, bool(held)

    def _buffer(self, oneoff: int, held: bool) -> torch.Tensor:
        """Where the next bucket goes: a one-off buffer of ``oneoff`` bytes for a tensor bigger than a slot, else a
        slot (shared memory) or the sender's staging buffer (collectives: the receivers' buffers come fresh)."""
        if oneoff:
            return self._map(oneoff) if self.transport == "shm" else torch.empty(oneoff, dtype=torch.uint8)
        if self.transport != "shm":
            if self.staging is None:
                self.staging = torch.empty(self.capacity, dtype=torch.uint8)
            return self.staging
        index, self.turn = self.turn % 2, self.turn + 1
        if held:
            self.slots[index] = self._map(self.capacity)
            self.remapped += 1
        return self.slots[index]

    def close(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()
        self.pg, self.store, self.slots, self.staging, self.ending = None, None, [], None, None


def _cause(e: BaseException) -> str:
    """The error's first sentence, without gloo's source location and advice."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]


class WeightPushSender(_Channel):
    def __init__(self, address: str, receivers: int, capacity: int, transport: str = "auto",
                 timeout_s: float = 300):
        super().__init__(address, 0, receivers, capacity, transport, timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        """Push one version to every receiver; returns when all of it has been handed over (the last bucket written
        or sent), not when the receivers have taken it: the trainer goes on while the engines load. The next
        ``send`` (or ``landed``) waits for that."""
        if version < 0:
            raise ValueError(f"weight push version {version}: expected the learner's update count (>= 0)")
        start, stats = time.perf_counter(), PushStats(0.0, 0, 0, 0)
        with self._failing():
            self.landed()
            self.version, self.pushing = version, True
            self._connect()
            self._announce(PUSH)
            header: list[list] = []     # [name, dtype, shape, offset] of each tensor in the open bucket
            buffer, used = torch.empty(0, dtype=torch.uint8), 0
            for name, tensor in named_tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if header and _aligned(used) + nbytes > buffer.numel():
                    self._flush(buffer, header, used)
                    header = []
                if not header:
                    oneoff = nbytes if nbytes > self.capacity else 0
                    buffer, used = self._buffer(oneoff, self._announce(BUCKET, oneoff)[3]), 0
                    stats.buckets += 1
                offset = _aligned(used)
                buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                header.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
                used = offset + nbytes
                stats.bytes, stats.tensors = stats.bytes + nbytes, stats.tensors + 1
            if header:
                self._flush(buffer, header, used)
            message = torch.tensor([END, self.version, 0, 0])     # what _announce(END) sends, answered later
            self.ending = (self.pg.allreduce(message, dist.ReduceOp.MAX), message)
        self.pushing = False
        stats.seconds = time.perf_counter() - start
        return stats

    def landed(self) -> None:
        """Returns once every receiver has taken the last push whole (its engine loaded it), at most the timeout."""
        if self.ending is not None:
            with self._failing():
                work, self.ending = self.ending[0], None
                self._wait(work)

    def _flush(self, buffer: torch.Tensor, header: list, used: int) -> None:
        """The bucket's header, then (collectives) its bytes; with shared memory they are in place already."""
        text = torch.frombuffer(bytearray(json.dumps([used, header]).encode()), dtype=torch.uint8)
        self._wait(self.pg.broadcast(torch.tensor([text.numel()]), 0))
        self._wait(self.pg.broadcast(text, 0))
        if self.transport != "shm":
            self._wait(self.pg.broadcast(buffer[:used], 0))


class WeightPushReceiver(_Channel):
    def __init__(self, address: str, rank: int, receivers: int, capacity: int, transport: str = "auto",
                 timeout_s: float = 300):
        if rank == 0:
            raise ValueError("weight push receiver rank 0: receivers are ranks 1..receivers (0 is the sender)")
        super().__init__(address, rank, receivers, capacity, transport, timeout_s)

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Wait (at most the timeout) for the next push; its version and its tensors, which must all be consumed
        before the next ``receive`` (the sender moves in step with the consumer)."""
        if self.pushing:
            raise WeightPushError(f"{self._push()}: receive() called before its tensors were all consumed; the "
                                  "channel is out of step with the sender")
        with self._failing():
            self._connect()
            kind, version, _, _ = self._announce()
        if kind != PUSH:
            raise WeightPushError(f"{self._push()}: expected the start of a push from {self._peer()}, got "
                                  f"message kind {kind}; the channel is out of step")
        self.version = version
        self.pushing = True
        return self.version, self._tensors()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._failing():
                kind, _, oneoff, held = self._announce()
                if kind == END:
                    break
                views = self._bucket(oneoff, held)
            yield from views
            del views
        self.pushing = False

    def _bucket(self, oneoff: int, held: bool) -> list[tuple[str, torch.Tensor]]:
        """The next bucket's tensors: views of its slot (shared memory) or of a fresh buffer (collectives)."""
        slot = self._buffer(oneoff, held) if self.transport == "shm" else None
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(self.pg.broadcast(length, 0))
        text = torch.empty(int(length), dtype=torch.uint8)
        self._wait(self.pg.broadcast(text, 0))
        used, header = json.loads(bytes(text.numpy()))
        if slot is None:
            slot = torch.empty(used, dtype=torch.uint8)
            self._wait(self.pg.broadcast(slot, 0))
        views = []
        for name, dtype_name, shape, offset in header:
            dtype = getattr(torch, dtype_name)
            views.append((name, slot[offset: offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype)
                          .view(shape)))
        return views
