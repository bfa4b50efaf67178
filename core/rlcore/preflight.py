"""What plugins check in a run's settings before any worker starts: at the start of a run and on ``--dry-run``, by
the same functions, so a dry run refuses what the run would."""
from __future__ import annotations

from typing import Any

from rlcore.config import Config
from rlcore.registry import Registry


def check_optimizers(cfg: Config, registry: Registry, needs_critic: bool) -> None:
    """Each trained model's optimizer plugin checks its section (``offload_fraction``: hybrid_adam's)."""
    for section, model in [("actor", cfg.actor)] + ([("critic", cfg.critic)] if needs_critic else []):
        optimizer = registry.get("optimizers", model.optim.name)
        if optimizer.check:
            optimizer.check(model.optim, f"{section}.optim")


def check_rollout_backend(cfg: Config, registry: Registry, hf_config: dict[str, Any], here: bool = True) -> None:
    """The rollout backend says whether it can serve this model (architecture, sizes) with these settings; ``here``:
    on this machine (false for a dry run, which plans for others)."""
    backend = registry.get("rollout_backends", cfg.rollout.backend)
    if backend.check:
        backend.check(hf_config, cfg.rollout, here)
