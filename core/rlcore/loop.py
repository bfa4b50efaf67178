"""The RL loop. Each step: the rollout source gives the step's trajectories (grouped per prompt, scored), they
become the training batch, the learner updates on it and hands its weights to the source, and the cadence runs
(evaluation, loggers, checkpoint, hooks); a run asked to stop (SIGTERM) stops there. The loop sees those three parts
only; ``rlcore.run`` builds them."""
from __future__ import annotations

import time

from rlcore.cadence import Cadence
from rlcore.data import Batch
from rlcore.learner import Learner
from rlcore.rewards import Scores
from rlcore.rollout.source import Source
from rlcore.trajectory import Trajectory, to_batch


def train(source: Source, learner: Learner, cadence: Cadence, done: int, steps: int) -> None:
    """Steps ``done + 1`` to ``steps``, each followed by its cadence, until the cadence says the run stops."""
    for number in range(done + 1, steps + 1):
        cadence.begin(number)
        start = time.perf_counter()
        metrics = step(source, learner, cadence, number)
        metrics["time/step"] = time.perf_counter() - start
        cadence.after(number, metrics)
        if cadence.stopping(number):       # asked to stop: this step is checkpointed
            return


def step(source: Source, learner: Learner, cadence: Cadence, number: int) -> dict[str, float]:
    """One RL step; returns its metrics."""
    timer = cadence.timer(number)
    rollout = source.next_groups(number, learner.version, timer)
    metrics = {**rollout.metrics, **reward_metrics(rollout.scores)}
    if not rollout.trajectories:   # dynamic sampling found no group with a learning signal: nothing to train on
        metrics["sampling/skipped_update"] = 1.0
    else:
        batch = to_batch(rollout.trajectories, source.pad_id)
        cadence.rollout_end(number, batch)
        metrics.update(learner.update(batch, number, timer))
        metrics.update(length_metrics(rollout.trajectories, batch))
        metrics.update(source.trajectory_metrics(rollout.trajectories))
    metrics.update(source.push_weights(learner.weights(), learner.version, number, timer))
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
    return metrics


def reward_metrics(scores: Scores) -> dict[str, float]:
    """Over every response sampled in the step (dropped groups included): the policy's actual reward."""
    scored = scores.total[~scores.failed]
    return {**scores.metrics(),
            "reward/mean": float(scored.mean()) if len(scored) else float("nan"),
            "reward/std": float(scored.std()) if len(scored) > 1 else 0.0}


def length_metrics(trajectories: list[Trajectory], batch: Batch) -> dict[str, float]:
    """Prompt and response lengths of the trained trajectories, and how many hit rollout.max_response_len."""
    return {"prompt/length_mean": sum(t.prompt_len for t in trajectories) / len(trajectories),
            "prompt/length_max": float(max(t.prompt_len for t in trajectories)),
            "response/length_mean": float(batch["response_len"].float().mean()),
            "response/length_max": float(batch["response_len"].max()),
            "response/truncated_frac": sum(t.finish == "length" for t in trajectories) / len(trajectories)}
