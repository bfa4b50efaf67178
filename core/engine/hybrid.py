"""One state machine for the train <-> rollout hand-off, and the weight sync it performs.

rollout mode: resume rollout memory (if the backend can release it) -> push the actor's weights.
train mode:   release rollout memory (if it can).
Offloading actor parameters / optimizer state slots into this order when configured (parallel issue).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from rlcore.specs import RolloutBackend


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int


class HybridEngine:
    TRAIN, ROLLOUT = "train", "rollout"

    def __init__(self, actor, rollout: RolloutBackend, in_sync: bool = False):
        """``in_sync``: the engine was started from the checkpoint the actor loaded, so no first push is needed."""
        self.actor, self.rollout = actor, rollout
        self.mode = self.TRAIN
        self.weights_version = 0                      # actor updates since construction
        self.synced_version = 0 if in_sync else -1    # the version the rollout engine holds
        self.history: list[str] = []      # transitions, for tests of the order

    def mark_updated(self) -> None:
        self.weights_version += 1

    def rollout_mode(self) -> SyncStats | None:
        """Enter rollout mode; push weights if the engine's copy is stale. Returns the sync's cost, if any."""
        if self.mode == self.ROLLOUT:
            return None
        if self.rollout.can_release_memory:
            self.rollout.resume_memory()
            self.history.append("resume_rollout_memory")
        stats = None
        if self.synced_version != self.weights_version:
            stats = self.sync_weights()
        self.mode = self.ROLLOUT
        return stats

    def train_mode(self) -> None:
        if self.mode == self.TRAIN:
            return
        if self.rollout.can_release_memory:
            self.rollout.release_memory()
            self.history.append("release_rollout_memory")
        self.mode = self.TRAIN

    def sync_weights(self) -> SyncStats:
        counted = {"bytes": 0, "tensors": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.actor.hf_weights():
                counted["bytes"] += tensor.numel() * tensor.element_size()
                counted["tensors"] += 1
                yield name, tensor

        start = time.perf_counter()
        self.rollout.update_weights(stream())
        self.synced_version = self.weights_version
        self.history.append("sync_weights")
        return SyncStats(time.perf_counter() - start, counted["bytes"], counted["tensors"])
