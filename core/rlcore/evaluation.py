"""Held-out scores from ``trainer.eval_n`` responses per prompt (greedy at ``eval_temperature`` 0, sampled above):
mean@n (the mean reward) and pass@n (the best of the n, per prompt: for 0/1 rewards the fraction of prompts at least
one response solves), overall and per ``data_source``. ``eval/accuracy`` is the overall mean@n, the number the
progress bar, the summary and the reward-curve PNG show."""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlcore.config import Config
    from rlcore.rollout.source import Source
    from rlcore.specs import Task


def evaluate(source: "Source", task: "Task", cfg: "Config", step: int) -> dict[str, float]:
    """Held-out scores after ``step``, ``trainer.eval_n`` responses per prompt at ``trainer.eval_temperature``;
    empty when the task has no held-out prompts."""
    from rlcore.rollout.source import prompt_seeds

    prompts, n = task.eval_prompts(), cfg.trainer.eval_n
    if not prompts:
        return {}
    source.sync()
    _, scores = source.groups(prompts, n, cfg.trainer.eval_temperature, prompt_seeds(len(prompts), cfg.run.seed,
                                                                                       "eval", step))
    metrics = eval_metrics(scores.total.view(len(prompts), n), [m.get("data_source", "") for _, m in prompts])
    if len(scores.components) > 1:     # each component too (as reward/<name>/mean is): a reward model's score
        metrics.update({f"eval/{key}": value for key, value in scores.metrics().items()   # beside what it stands for
                        if key.endswith("/mean")})
    return metrics


def eval_metrics(rewards: torch.Tensor, sources: list[str]) -> dict[str, float]:
    """``rewards`` [prompts, n] (NaN = the reward failed: counted as wrong), ``sources`` one per prompt."""
    rewards = torch.nan_to_num(rewards.double(), nan=0.0)
    n = rewards.shape[1]
    mean, best = rewards.mean(dim=1), rewards.max(dim=1).values
    metrics = {"eval/accuracy": float(mean.mean()), f"eval/mean@{n}": float(mean.mean()),
               f"eval/pass@{n}": float(best.mean())}
    for source in sorted(set(sources) - {""}):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"eval/{source}/mean@{n}"] = float(mean[rows].mean())
        metrics[f"eval/{source}/pass@{n}"] = float(best[rows].mean())
    return metrics


_SCORE = re.compile(r"^eval/(?:(.+)/)?(mean|pass)@(\d+)$")


def eval_curves(evals: list[tuple[int, dict[str, float]]]) -> dict[str, list[tuple[int, float]]]:
    """The curves the reward-curve PNG draws besides eval/accuracy: ``{"<source> mean@n": [(step, value), ...]}``
    per data source, and pass@n overall and per source when n > 1 (at n = 1 it equals mean@1)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in evals:
        for key, value in metrics.items():
            match = _SCORE.match(key)
            if not match or math.isnan(value):
                continue
            source, kind, n = match[1], match[2], int(match[3])
            if (kind == "pass" and n == 1) or (kind == "mean" and source is None):
                continue
            curves.setdefault(f"{source + ' ' if source else ''}{kind}@{n}", []).append((step, value))
    return curves
