"""The learning rate of each optimizer update: linear warm-up, then constant, cosine or linear decay to a minimum."""
from __future__ import annotations

import math

from rlcore.config.schema import OptimConfig, TrainedModelConfig

SCHEDULES = ("constant", "cosine", "linear")


def learning_rate(update: int, optim: OptimConfig, total_updates: int) -> float:
    """LR of optimizer update ``update`` (0-based) of ``total_updates``: during the first ``lr_warmup_steps``
    updates it rises linearly to ``lr`` (update u uses (u+1)/warmup of it, so no update is wasted at 0); then it
    stays at ``lr`` (constant) or decays to ``min_lr`` at the last update (cosine, linear)."""
    warmup = optim.lr_warmup_steps
    if update < warmup:
        return optim.lr * (update + 1) / warmup
    if optim.lr_schedule == "constant":
        return optim.lr
    span = max(total_updates - warmup - 1, 1)
    progress = min((update - warmup) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.lr_schedule == "cosine" else 1 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def total_updates(steps: int, model: TrainedModelConfig) -> int:
    """Optimizer updates in a run of ``steps`` RL steps: ``epochs`` passes of ``mini_batches`` updates each step."""
    return steps * model.mini_batches * model.epochs
