"""What the rollout sources call on the workers they are given, typed here so that the rollout side never imports
the workers (``rlcore.workers.proxies`` and ``rlcore.workers.rollout_worker`` implement these; ``rlcore.run``
hands them over)."""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from rlcore.data import Batch
from rlcore.specs import Sampling
from rlcore.trajectory import Trajectory
from rlcore.weight_sync.hybrid import SyncStats
from rlcore.weight_sync.logprob_check import LogprobComparison, Probe, ProbeImages


class ColocatedWorkers(Protocol):
    """The actor's workers with their engine shards (``ColocatedGroup``)."""

    def rollout_mode(self) -> SyncStats | None: ...

    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int] | None = None) -> list[list[Trajectory]]: ...

    def compare_logprobs(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                         images: list[ProbeImages] | None = None) -> list[LogprobComparison]: ...


class Weights(Protocol):
    """The learner's weights as a source moves them (``Learner.weights()``: the actor's workers, ``ActorGroup``):
    pushed by the workers to the engines over a channel of their own, never through the driver; and scored, for the
    engine check after a push."""

    def open_push(self, address: str, receivers: int) -> None: ...

    def push_weights(self, version: int) -> dict[str, float]: ...

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor: ...


class EngineWorkers(Protocol):
    """Async mode's rollout workers (``RolloutWorkers``), by slot: each call returns one Ray reference per worker it
    names (``members``, slots in order) at once. A slot's worker may die and be replaced, slots be added or retired
    (``rlcore.rollout.roster``)."""
    world: int                # slots
    where: list[dict]         # per slot: its worker's pid, host, and whether its engine started without weights

    def open_push(self, address: str, members: list[int]) -> list: ...

    def receive_weights(self, probe: Probe | None, members: list[int]) -> list: ...

    def stats(self, members: list[int]) -> list: ...

    def episodes(self, worker: int, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int], tag: str) -> Any: ...

    def stream_groups(self, worker: int, prompts: list[list[int]], metadata: list[dict], n: int,
                      sampling: Sampling, seeds: list[int], tag: str) -> Any: ...

    def failed(self, index: int, error: BaseException) -> str: ...

    def is_death(self, error: BaseException) -> bool: ...

    def start_worker(self, index: int, started: Callable[[dict | None, BaseException | None], None]) -> None: ...

    def stop_worker(self, index: int) -> None: ...


class RewardModelWorkers(Protocol):
    """A reward model's workers (``RewardModelGroup``): each row's score."""

    def scores(self, batch: Batch) -> torch.Tensor: ...
