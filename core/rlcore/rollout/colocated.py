"""The colocated rollout source: the engine lives in the actor's workers, on the same devices, and generates only
while the learner waits (queue depth 0). Entering rollout mode brings the engine up to the learner's weights (the
hybrid engine pushes them when they changed), so every trajectory it returns was sampled by the learner's current
version."""
from __future__ import annotations

from typing import Callable

import torch

from rlcore.config import Config
from rlcore.weight_sync.logprob_check import raise_if_disagree, worst
from rlcore.multimodal import ImagePrompts
from rlcore.rewards import RewardComposer, Scores, SourceDispatch
from rlcore.rollout.groups import GroupFilter
from rlcore.rollout.handles import ColocatedWorkers, Weights
from rlcore.rollout.source import Source, StepRollout, prompt_seeds
from rlcore.specs import Sampling, Task
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory


class ColocatedSource(Source):
    """The episodes run on the actor's workers' engines (``ColocatedWorkers.episodes``),
    ``trainer.prompts_per_step`` kept groups a step."""

    def __init__(self, cfg: Config, workers: ColocatedWorkers, task: Task, tokenizer, max_len: int,
                 rewards: RewardComposer | SourceDispatch, keep_group: Callable[[torch.Tensor], bool],
                 agent_metrics: Callable[[list[Trajectory]], dict[str, float]] | None = None,
                 images: ImagePrompts | None = None):
        super().__init__(cfg, task, tokenizer, max_len, rewards, keep_group, agent_metrics, images)
        self.workers = workers

    # --- the engine ----------------------------------------------------------------------------------------------
    def sync(self) -> dict[str, float]:
        """Rollout mode: the engine gets the learner's weights if they changed; what the push moved."""
        pushed = self.workers.rollout_mode()
        return {} if pushed is None else {"sync/bytes": float(pushed.bytes), "sync/tensors": float(pushed.tensors)}

    def check_logprobs(self, seed: int = 0) -> float:
        """The engine-vs-actor check on a fixed batch, on every rank; raises past trainer.logprob_tolerance."""
        self.workers.rollout_mode()
        prompts, responses, images = self.probe(seed)
        result = worst(self.workers.compare_logprobs(prompts, responses, self.pad_id, images))
        raise_if_disagree(result, self.cfg.trainer.logprob_tolerance)
        return result.max_abs_diff

    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int]) -> list[list[Trajectory]]:
        return self.workers.episodes(prompts, metadata, n, sampling, seeds)

    # --- what the loop asks for ----------------------------------------------------------------------------------
    def push_weights(self, weights: Weights, version: int, step: int, timer: Timer | None = None) -> dict[str, float]:
        """Nothing moves here: the workers' hybrid engine takes the actor's weights, in the workers, when it next
        enters rollout mode (``sync``)."""
        return {}

    def next_groups(self, step: int, version: int, timer: Timer) -> StepRollout:
        """The step's trajectories: ``trainer.prompts_per_step`` groups the filter keeps, sampled in rounds of that
        many prompts (at most ``rollout.max_sampling_rounds``); and the scores of everything sampled, kept or not
        (the reward metrics). The engine is brought up to date first and checked on its cadence."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        with timer("sync"):
            metrics.update(self.sync())
        if cfg.trainer.check_logprobs_every and step % cfg.trainer.check_logprobs_every == 0:
            metrics["check/logprob_max_diff"] = self.check_logprobs(seed=step)
        wanted = cfg.trainer.prompts_per_step
        kept, scored, rounds = GroupFilter(self.keep_group, wanted), [], 0
        while rounds < cfg.rollout.max_sampling_rounds and not kept.full:
            prompts = self.task.train_prompts(step, wanted * (rounds + 1))[wanted * rounds:]
            rounds += 1
            seeds = prompt_seeds(len(prompts), cfg.run.seed, "train", step, rounds)
            groups, scores = self.groups(prompts, cfg.rollout.n, cfg.rollout.temperature, seeds, timer)
            stale = {t.version for g in groups for t in g} - {(version, version)}
            if stale:       # the engine is brought to the learner's weights before sampling: a bug if not
                raise RuntimeError(f"the colocated engine sampled with weight versions {sorted(stale)}, the learner "
                                   f"is at {version}")
            kept.offer(groups)
            scored.append(scores)
        metrics.update({"sampling/groups_dropped": float(kept.dropped), "sampling/rounds": float(rounds),
                        "sampling/groups_kept": float(len(kept.kept))})
        return StepRollout(kept.trajectories(), Scores.cat(scored), metrics)

