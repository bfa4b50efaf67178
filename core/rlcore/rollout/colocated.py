"""The colocated rollout source: the engine lives in the actor's workers, on the same devices, and generates only
while the learner waits (queue depth 0). Entering rollout mode brings the engine up to the learner's weights (the
hybrid engine pushes them when they changed), so every trajectory it returns was sampled by the learner's current
version."""
from __future__ import annotations

import contextlib
import logging
import random
from typing import TYPE_CHECKING, Callable

import torch

from rlcore.config import Config
from rlcore.weight_sync.logprob_check import fixed_probe, raise_if_disagree
from rlcore.errors import RlcoreError
from rlcore.rewards import RewardComposer, Scores, SourceDispatch, neutral_fill
from rlcore.rollout.groups import GroupFilter
from rlcore.specs import Sampling, Task
from rlcore.trajectory import Trajectory

if TYPE_CHECKING:
    from rlcore.workers.group import WorkerGroup

log = logging.getLogger(__name__)


class ColocatedSource:
    """Prompts from ``task`` → ``rollout.n`` trajectories each from the workers' engines → scored by ``rewards`` →
    the groups ``keep_group`` accepts (dynamic sampling), ``trainer.prompts_per_step`` of them a step."""

    def __init__(self, cfg: Config, workers: "WorkerGroup", task: Task, tokenizer, max_len: int,
                 rewards: RewardComposer | SourceDispatch, keep_group: Callable[[torch.Tensor], bool]):
        self.cfg, self.workers, self.task, self.tokenizer = cfg, workers, task, tokenizer
        self.rewards, self.keep_group, self.max_len = rewards, keep_group, max_len
        self.failure_reasons_seen: set[str] = set()

    # --- tokens and rewards --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) + self.cfg.rollout.max_response_len > self.max_len:
            raise RlcoreError(f"prompt {text[:40]!r} has {len(ids)} tokens; with rollout.max_response_len "
                              f"{self.cfg.rollout.max_response_len} it exceeds the model's context "
                              f"{self.max_len}. Shorten prompts or lower rollout.max_response_len.")
        return ids

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)          # one sequence in, one string out
        return text

    def score(self, texts: list[str], meta: list[dict]) -> Scores:
        scores = self.rewards(texts, meta)
        for reason, count in scores.reasons.items():
            if reason not in self.failure_reasons_seen:   # each reason once; counts go to the metrics
                self.failure_reasons_seen.add(reason)
                log.warning("reward failed for %d sample(s), marked failed and left out of the loss: %s", count,
                            reason)
        return scores

    # --- the engine ----------------------------------------------------------------------------------------------
    def sync(self) -> dict[str, float]:
        """Rollout mode: the engine gets the learner's weights if they changed; what the push moved."""
        pushed = self.workers.rollout_mode()
        return {} if pushed is None else {"sync/bytes": float(pushed.bytes), "sync/tensors": float(pushed.tensors)}

    def check_logprobs(self, seed: int = 0) -> float:
        """The engine-vs-actor check on a fixed batch, on every rank; raises past trainer.logprob_tolerance."""
        self.workers.rollout_mode()
        probe = fixed_probe(len(self.tokenizer), seed=seed)
        results = self.workers.call("compare_logprobs", *probe, self.tokenizer.eos_token_id)
        worst = max(results, key=lambda r: r.max_abs_diff)
        raise_if_disagree(worst, self.cfg.trainer.logprob_tolerance)
        return worst.max_abs_diff

    def groups(self, prompts: list[tuple[str, dict]], n: int, temperature: float, seeds: list[int],
               timer=None) -> tuple[list[list[Trajectory]], Scores]:
        """``n`` scored episodes of the run's agent for each prompt (sampled with its seed at ``temperature``), one
        group per prompt, and their scores in that order; ``timer`` times the phases (rollout, reward)."""
        timer = timer or (lambda phase: contextlib.nullcontext())
        with timer("rollout"):
            groups = self.workers.episodes([self.encode(p) for p, _ in prompts], [m for _, m in prompts], n,
                                           Sampling(self.cfg.rollout.max_response_len, temperature), seeds)
        flat = [t for group in groups for t in group]
        with timer("reward"):
            scores = self.score([self.decode(t.tokens[t.prompt_len:]) for t in flat], [t.metadata for t in flat])
        rewards = neutral_fill(scores.total, scores.failed, torch.arange(len(prompts)).repeat_interleave(n)).float()
        for row, t in enumerate(flat):
            t.group, t.reward, t.failed = row // n, float(rewards[row]), bool(scores.failed[row])
        return groups, scores

    # --- what the loop asks for ----------------------------------------------------------------------------------
    def next_groups(self, step: int, version: int, timer, metrics: dict) -> tuple[list[Trajectory], Scores]:
        """The step's trajectories: ``trainer.prompts_per_step`` groups the filter keeps, sampled in rounds of that
        many prompts (at most ``rollout.max_sampling_rounds``); and the scores of everything sampled, kept or not
        (the reward metrics). The engine is brought up to date first and checked on its cadence."""
        cfg = self.cfg
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
        return kept.trajectories(), Scores.cat(scored)


def prompt_seeds(count: int, run_seed: int, *where) -> list[int]:
    """One rollout seed for each of ``count`` prompts, fixed by the run's seed and where the prompts are drawn
    (``"train", step, round`` / ``"eval", step``): a resumed run samples exactly what the uninterrupted one did."""
    key = "/".join(map(str, (run_seed, *where)))
    return [random.Random(f"{key}/{i}").getrandbits(31) for i in range(count)]
