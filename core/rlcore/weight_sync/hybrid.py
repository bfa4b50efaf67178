"""One state machine for the train <-> rollout hand-off, and the weight sync it performs.

rollout mode: offload optimizer state, offload grads (if configured) -> wake the engine's weights -> push the
              actor's weights (if stale) -> offload actor params (if configured) -> wake the engine's KV cache.
train mode:   release the engine's memory -> onload params, grads, optimizer state (those offloaded).
The engine steps run only for backends that can release memory (vLLM's CPU build cannot).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from rlcore.megatron.host_memory import offloaded_parts
from rlcore.specs import RolloutBackend
from rlcore.lora.sync import AdapterSync


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int


class HybridEngine:
    TRAIN, ROLLOUT = "train", "rollout"

    def __init__(self, actor, rollout: RolloutBackend, in_sync: bool = False, offload=None,
                 adapters: AdapterSync | None = None):
        """``in_sync``: the engine was started from the checkpoint the actor loaded, so no first push is needed.
        ``offload``: which of params / grads / optimizer the actor moves to host memory in rollout mode.
        ``adapters``: a sync sends the LoRA adapters only (``rollout.lora=adapters``), else every weight."""
        self.actor, self.rollout, self.adapters = actor, rollout, adapters
        self.offloaded = offloaded_parts(offload)
        self.mode = self.TRAIN
        self.synced_version = 0 if in_sync else -1    # the version the rollout engine holds (-1: none loaded yet)
        self.history: list[str] = []      # transitions, for tests of the order

    @property
    def version(self) -> int:
        """The actor's weights version: its optimizer updates (``MegatronTrainable.updates``, restored with a
        checkpoint), as the driver's Learner.version counts them; pushed with the weights, the engine holds it as
        RolloutBackend.version and reports it with each completion."""
        return self.actor.updates

    def rollout_mode(self) -> SyncStats | None:
        """Enter rollout mode; push weights if the engine's copy is stale. Returns the sync's cost, if any."""
        if self.mode == self.ROLLOUT:
            return None
        for what in self.offloaded:
            if what != "params":
                self._do(f"offload_{what}", self.actor.offload, what)
        if self.rollout.can_release_memory:
            self._do("resume_rollout_weights", self.rollout.resume_memory, "weights")
        stats = None
        if self.synced_version != self.version:
            stats = self.sync_weights()
        if "params" in self.offloaded:
            self._do("offload_params", self.actor.offload, "params")
        if self.rollout.can_release_memory:
            self._do("resume_rollout_kv_cache", self.rollout.resume_memory, "kv_cache")
        self.mode = self.ROLLOUT
        return stats

    @contextmanager
    def actor_params_on_device(self) -> Iterator[None]:
        """Within the block the actor's parameters are on the device, also in rollout mode with them offloaded (the
        engine check reads the actor between sync and generation); offloaded again after it."""
        offloaded = self.mode == self.ROLLOUT and "params" in self.offloaded
        if offloaded:
            self.actor.onload("params")
        try:
            yield
        finally:
            if offloaded:
                self.actor.offload("params")

    def train_mode(self) -> None:
        if self.mode == self.TRAIN:
            return
        if self.rollout.can_release_memory:
            self._do("release_rollout_memory", self.rollout.release_memory)
        for what in reversed(self.offloaded):
            self._do(f"onload_{what}", self.actor.onload, what)
        self.mode = self.TRAIN

    def _do(self, step: str, fn, *args) -> None:
        fn(*args)
        self.history.append(step)

    def sync_weights(self) -> SyncStats:
        if self.adapters is not None:
            return self._sync_adapters(self.adapters)
        counted = {"bytes": 0, "tensors": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.actor.hf_weights():
                counted["bytes"] += tensor.numel() * tensor.element_size()
                counted["tensors"] += 1
                yield name, tensor

        start = time.perf_counter()
        self.rollout.update_weights(stream(), self.version)
        self.synced_version = self.version
        self.history.append("sync_weights")
        return SyncStats(time.perf_counter() - start, counted["bytes"], counted["tensors"])

    def _sync_adapters(self, adapters: AdapterSync) -> SyncStats:
        start = time.perf_counter()
        tensors = adapters.tensors()
        self.rollout.load_adapters(tensors, adapters.config, self.version)
        self.synced_version = self.version
        self.history.append("sync_adapters")
        return SyncStats(time.perf_counter() - start, sum(t.numel() * t.element_size() for t in tensors.values()),
                         len(tensors))
