"""The learning side: from a batch of trajectories to updated weights — the old policy's and the reference's
logprobs, the critic's values, the algorithm's advantages, and the mini-batch updates of the critic and the actor
(the actor's loss: ``actor_loss``). ``version`` counts the actor's optimizer updates, as the workers' hybrid engine
does when it pushes weights to the rollout engine (which reports it with each completion): a row whose version
equals it was sampled by the weights about to be updated."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from rlcore.config import Config
from rlcore.data import Batch
from rlcore.errors import RlcoreError
from rlcore.learner.routing import routing_metrics
from rlcore.routed_experts import ROUTED_EXPERTS
from rlcore.specs import Algorithm
from rlcore.timing import Timer


class ActorWorkers(Protocol):
    """The actor's workers as the learner calls them (``rlcore.workers.proxies.ActorGroup``)."""

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor: ...

    def train_step(self, mini: Batch, single_update: bool) -> dict[str, float]: ...

    def live_routing(self, batch: Batch) -> torch.Tensor: ...

    def train_mode(self) -> None: ...

    def open_push(self, address: str, receivers: int) -> None: ...

    def push_weights(self, version: int) -> dict[str, float]: ...


class CriticWorkers(Protocol):
    """The critic's workers (``rlcore.workers.proxies.CriticGroup``): asleep (offloaded) between their passes."""

    def values(self, batch: Batch) -> torch.Tensor: ...

    def train_step(self, mini: Batch) -> dict[str, float]: ...

    def wake(self) -> None: ...

    def sleep(self) -> None: ...


class Learner:
    def __init__(self, cfg: Config, actor: ActorWorkers, critic: CriticWorkers | None, algorithm: Algorithm,
                 algo_cfg: Any):
        self.cfg, self.actor, self.critic, self.algorithm, self.algo_cfg = cfg, actor, critic, algorithm, algo_cfg
        self.version = 0

    def weights(self) -> ActorWorkers:
        """The actor's weights, as a handle: its workers, which push them to a source's engines themselves (the
        driver never holds them) and score with them for the engine check (``rlcore.rollout.handles.Weights``)."""
        return self.actor

    def single_update(self) -> bool:
        """The batch gets one optimizer update: the old (proximal) policy, the weights before the update, is then
        what the update's own forward computes, detached (no separate pass), whichever weights sampled the rows
        (async mode's stale rows included: their behaviour policy is the engine's logprobs, corrected against it)."""
        return self.cfg.actor.mini_batches == 1 and self.cfg.actor.epochs == 1

    def update(self, batch: Batch, step: int, timer: Timer) -> dict[str, float]:
        """One step's learning on ``batch``; returns its metrics. The actor trains from ``critic.warmup_steps`` on."""
        cfg, algorithm, algo_cfg = self.cfg, self.algorithm, self.algo_cfg
        single_update = self.single_update()
        metrics: dict[str, float] = {}
        self.actor.train_mode()
        with timer("logprobs"):
            if cfg.actor.old_logprobs == "rollout":     # the engine's own: no forward pass
                batch["old_logprobs"] = batch["rollout_logprobs"]
            elif not single_update or algorithm.needs_old_logprobs(algo_cfg):
                batch["old_logprobs"] = self.actor.logprobs(batch)
            if algorithm.needs_reference(algo_cfg):
                batch["ref_logprobs"] = self.actor.logprobs(batch, reference=True)
        if cfg.actor.moe.routing_replay == "rollout" and cfg.actor.moe.measure_live_routing and ROUTED_EXPERTS in batch:
            with timer("live_routing"):
                live = self.actor.live_routing(batch)
            metrics.update(routing_metrics(batch, live[..., 0], live[..., 1]))
        if self.critic is not None:
            with timer("values"):
                self.critic.wake()
                batch["values"] = self.critic.values(batch)
        advantages, adv_metrics = algorithm.advantages(batch, algo_cfg)
        batch["advantages"] = advantages
        mask = batch["response_mask"]
        metrics.update(adv_metrics)
        metrics.update(token_stats("advantage", advantages, mask))
        if self.critic is not None:
            if "returns" not in batch:
                raise RlcoreError(f"algorithm {algorithm.name!r} trains a critic but its advantages() left no "
                                  f"batch['returns'] (the critic's targets): the plugin must store them")
            metrics.update(token_stats("returns", batch["returns"], mask))
            metrics.update(token_stats("values", batch["values"], mask))
            with timer("critic"):
                metrics.update(mini_batch_updates(self.critic, cfg.critic, batch)[0])
                self.critic.sleep()
        if self.critic is None or step > cfg.critic.warmup_steps:
            with timer("train"):
                actor_metrics, updates = mini_batch_updates(self.actor, cfg.actor, batch, single_update)
            metrics.update(actor_metrics)
            self.version += updates
        return metrics


def mini_batch_updates(group: ActorWorkers | CriticWorkers, model_cfg, batch: Batch,
                       *args) -> tuple[dict[str, float], int]:
    """``epochs`` passes of ``mini_batches`` optimizer updates over the batch, for the actor's or the critic's
    workers; returns the mean of each metric and how many updates there were."""
    size = -(-len(batch) // model_cfg.mini_batches)
    collected: dict[str, list[float]] = {}
    updates = 0
    for _ in range(model_cfg.epochs):
        for mini in batch.split(size):
            updates += 1
            for k, v in group.train_step(mini, *args).items():
                collected.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in collected.items()}, updates


def token_stats(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of a per-token tensor over the response tokens."""
    picked = values[mask > 0]
    if not len(picked):
        return {}
    return {f"{name}/mean": float(picked.mean()), f"{name}/std": float(picked.std()) if len(picked) > 1 else 0.0,
            f"{name}/min": float(picked.min()), f"{name}/max": float(picked.max())}
