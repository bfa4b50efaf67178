"""Typed proxies of the trained worker groups: one method per remote call the run's parts make, each naming the
worker method it reaches (mypy checks both ends). The parts receive them through their constructors, typed by
Protocols of their own packages (``rlcore.learner``, ``rlcore.rollout.handles``, ``rlcore.checkpoint``,
``rlcore.profiling``); only ``rlcore.run`` builds them."""
from __future__ import annotations

import torch

from rlcore.data import Batch
from rlcore.specs import Sampling
from rlcore.trajectory import Trajectory
from rlcore.weight_sync.hybrid import SyncStats
from rlcore.weight_sync.logprob_check import LogprobComparison, ProbeImages
from rlcore.workers.colocated import ActorRolloutWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.group import WorkerGroup, shares
from rlcore.workers.offloading import OffloadingWorker
from rlcore.workers.reward_model import RewardModelTrainer, RewardModelWorker
from rlcore.workers.worker import ActorWorker, Worker


class TrainGroup(WorkerGroup):
    """What every trained model's workers do: checkpoints and profiled phases."""

    def save_checkpoint(self, directory: str, asynchronous: bool) -> None:
        self.call(Worker.save_checkpoint, directory, asynchronous)

    def finish_checkpoint(self, blocking: bool) -> bool:
        """Whether every rank's asynchronous save is complete (all are polled)."""
        return all(self.call(Worker.finish_checkpoint, blocking))

    def load_checkpoint(self, directory: str) -> None:
        self.call(Worker.load_checkpoint, directory)

    def profile_begin(self, directory: str, name: str, phase: str) -> None:
        self.call_each(Worker.profile_begin, [(directory, name)] * self.world, phase=phase)

    def profile_end(self, phase: str) -> list[list[str]]:
        return self.call_each(Worker.profile_end, [()] * self.world, phase=phase)


class ActorGroup(TrainGroup):
    """The actor's workers (async mode's: the trainer, which pushes its weights to the rollout workers)."""
    worker_cls = ActorWorker

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        return self.per_token(ActorWorker.logprobs, batch, reference)

    def train_step(self, mini: Batch, single_update: bool) -> dict[str, float]:
        return self.update(ActorWorker.train_step, mini, single_update)

    def live_routing(self, batch: Batch) -> torch.Tensor:
        return self.per_token(ActorWorker.live_routing, batch)

    def num_parameters(self) -> int:
        return self.call(ActorWorker.num_parameters)[0]

    def open_push(self, address: str, receivers: int) -> None:
        self.call(ActorWorker.open_push, address, receivers)

    def push_weights(self, version: int) -> dict[str, float]:
        """Collective; what global rank 0 sent."""
        return self.call(ActorWorker.push_weights, version)[0]

    def export_hf(self, directory: str) -> None:
        self.call(ActorWorker.export_hf, directory)

    def export_adapter(self, directory: str, base_path: str) -> None:
        self.call(ActorWorker.export_adapter, directory, base_path)

    def fingerprint(self) -> list[dict]:
        """Each rank's parameter sums (``ActorWorker.fingerprint``), in rank order."""
        return self.call(ActorWorker.fingerprint)

    def train_mode(self) -> None:
        self.call(ActorWorker.train_mode)


class ColocatedGroup(ActorGroup):
    """Colocated mode's actor workers, each with an engine shard that generates while the learner waits."""
    worker_cls = ActorRolloutWorker

    def rollout_mode(self) -> SyncStats | None:
        """Every rank's engine up to the learner's weights; what the push moved (None: nothing to push)."""
        return self.call(ActorRolloutWorker.rollout_mode)[0]

    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int] | None = None) -> list[list[Trajectory]]:
        """``n`` episodes of the run's agent per prompt (``rlcore.rollout.requests.episodes``); the prompts are
        split over the engine replicas, each with its prompts' metadata and seeds."""
        parts = shares(len(prompts), self.replicas)
        pick = lambda items, part: None if items is None else [items[i] for i in part]  # noqa: E731
        results = self.call_each(ActorRolloutWorker.episodes, [
            (pick(prompts, parts[c.rollout_replica]), pick(metadata, parts[c.rollout_replica]), n, sampling,
             pick(seeds, parts[c.rollout_replica])) for c in self.coords])
        by_replica = {c.rollout_replica: r for c, r in zip(self.coords, results) if c.leads_replica}
        return [g for i in range(self.replicas) for g in by_replica[i]]

    def compare_logprobs(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                         images: list[ProbeImages] | None = None) -> list[LogprobComparison]:
        """Each rank's engine-vs-actor comparison on the same sequences (with their images, if given)."""
        return self.call(ActorRolloutWorker.compare_logprobs, prompts, responses, pad_id, images)


class OffloadingGroup(TrainGroup):
    """Workers whose model waits in host memory between its passes (``rlcore.workers.offloading``)."""

    def wake(self) -> None:
        self.call(OffloadingWorker.wake)

    def sleep(self) -> None:
        self.call(OffloadingWorker.sleep)


class CriticGroup(OffloadingGroup):
    """The critic's workers; asleep (offloaded as ``critic.offload`` says) between their passes."""
    worker_cls = CriticWorker

    def values(self, batch: Batch) -> torch.Tensor:
        return self.per_token(CriticWorker.values, batch)

    def train_step(self, mini: Batch) -> dict[str, float]:
        return self.update(CriticWorker.train_step, mini)


class RewardModelGroup(OffloadingGroup):
    """The reward model's workers; asleep (offloaded as ``reward_model.offload`` says) between their passes."""
    worker_cls = RewardModelWorker

    def scores(self, batch: Batch) -> torch.Tensor:
        """Each row's score [N] (rows of ``rlcore.megatron.reward_model.score_batch``), awake for the pass."""
        from rlcore.megatron.reward_model import read_scores

        self.wake()
        try:
            return read_scores(self.per_token(RewardModelWorker.token_scores, batch), batch)
        finally:
            self.sleep()


class RewardModelTrainerGroup(RewardModelGroup):
    """``rlcore train-rm``'s workers: the reward model trained on preference pairs."""
    worker_cls = RewardModelTrainer

    def train_step(self, mini: Batch) -> dict[str, float]:
        """One update on a mini-batch of ``pair_batch`` rows."""
        return self.update(RewardModelTrainer.train_step, mini)

    def export_hf(self, directory: str, pad_token_id: int | None) -> None:
        self.call(RewardModelTrainer.export_hf, directory, pad_token_id)
