"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) as an rlcore algorithm plugin.

Each prompt is sampled k times; a sample's baseline is the mean reward of the *other* k-1 samples of its prompt, so
the advantage is unbiased without a learned critic: A_i = r_i - mean_{j != i} r_j = k/(k-1) * (r_i - mean_j r_j).
The policy loss is the importance-weighted REINFORCE term, clipped as in PPO so that several updates per batch stay
close to the sampling policy. Uses only rlcore's public API: ``Algorithm``, ``hookimpl``, ``rlcore.losses``,
``rlcore.rollout_correction``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.errors import ConfigError
from rlcore.hookspecs import hookimpl
from rlcore.losses import AGG_MODES, masked_mean
from rlcore.rollout_correction import RolloutCorrection, check_correction_options
from rlcore.specs import Algorithm


@dataclass
class RLOOConfig(RolloutCorrection):    # + algorithm.rollout_* (the engine-mismatch and off-policy correction)
    name: str = "rloo"
    clip_ratio: float = 0.2              # ratio clipped to [1 - clip_ratio, 1 + clip_ratio]
    loss_agg_mode: str = "token-mean"    # token-mean, seq-mean-token-mean or seq-mean-token-sum

    def __post_init__(self):
        if not 0 < self.clip_ratio < 1:
            raise ConfigError(f"algorithm.clip_ratio = {self.clip_ratio}: use a number between 0 and 1")
        if self.loss_agg_mode not in AGG_MODES:
            raise ConfigError(f"algorithm.loss_agg_mode = {self.loss_agg_mode!r}: use one of {', '.join(AGG_MODES)}")
        check_correction_options(self)


def leave_one_out_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                             cfg: RLOOConfig) -> tuple[torch.Tensor, dict]:
    """r_i minus the mean of the other samples of the same prompt, on every response token. A prompt sampled once
    has no baseline: its advantage is 0."""
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        k = int(idx.sum())
        if k > 1:
            r = rewards[idx]
            advantages[idx] = r - (r.sum() - r) / (k - 1)
    return advantages.unsqueeze(-1) * response_mask, {"rloo/advantage_abs_mean": float(advantages.abs().mean())}


def clipped_reinforce_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                           ref_logp: torch.Tensor | None, cfg: RLOOConfig) -> tuple[torch.Tensor, dict]:
    """Per token: max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)), ratio = pi / pi_old."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    return per_token, {"rloo/pg_loss": masked_mean(per_token, mask).item(),
                       "rloo/clip_frac": masked_mean((clipped > unclipped).float(), mask).item()}


RLOO = Algorithm(
    name="rloo", config_cls=RLOOConfig, policy_loss=clipped_reinforce_loss, loss_agg_mode=lambda cfg: cfg.loss_agg_mode,
    advantages=lambda batch, cfg: leave_one_out_advantages(batch["rewards"], batch["group_ids"],
                                                           batch["response_mask"], cfg))


@hookimpl
def rlcore_algorithms():
    return [RLOO]
