"""GRPO math: group-relative advantages and the clipped surrogate loss with an optional KL term."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.losses import check_policy_loss_options, clipped_surrogate, with_kl_loss
from rlcore.rollout_correction import RolloutCorrection


@dataclass
class GRPOConfig(RolloutCorrection):   # + algorithm.rollout_* (rlcore.rollout_correction)
    name: str = "grpo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True
    eps: float = 1e-6
    clip_ratio_c: float = 0.0            # dual-clip: for A < 0, cap the loss at -A * c (c > 1; 0 = off)
    overlong_buffer: int = 0             # soft overlong penalty over the last this many tokens (0 = off) ...
    overlong_max_len: int = 0            # ... of responses up to this length (set it to rollout.max_response_len)
    overlong_penalty: float = 1.0        # the penalty at overlong_max_len tokens, linear from 0 over the buffer
    dynamic_sampling: bool = False       # DAPO: drop groups whose rewards are all equal (no signal) and sample
                                         # more prompts in their place (up to rollout.max_sampling_rounds)

    def __post_init__(self):
        from rlcore.errors import ConfigError

        check_policy_loss_options(self)
        if self.overlong_buffer and not 0 < self.overlong_buffer <= self.overlong_max_len:
            raise ConfigError(f"algorithm.overlong_buffer = {self.overlong_buffer} needs algorithm.overlong_max_len "
                              f">= it (got {self.overlong_max_len}): set overlong_max_len to rollout.max_response_len")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                     cfg: GRPOConfig) -> tuple[torch.Tensor, dict]:
    """A_i = (r_i - mean(group)) / (std(group) + eps), the same for every response token of sample i.
    A group of one sample gets advantage 0 (its std is undefined). With the overlong penalty, rewards are shaped
    by response length first."""
    metrics = {}
    if cfg.overlong_buffer:
        penalty = overlong_penalty(response_mask.sum(-1), cfg)
        rewards = rewards.float() - penalty
        metrics["algo/overlong_penalty_mean"] = float(penalty.mean())
    scores = torch.zeros_like(rewards, dtype=torch.float32)
    uniform = 0
    groups = torch.unique(group_ids)
    for g in groups:
        idx = group_ids == g
        r = rewards[idx].float()
        centred = r - r.mean()
        if r.numel() > 1 and cfg.norm_adv_by_std:
            centred = centred / (r.std() + cfg.eps)
        scores[idx] = centred if r.numel() > 1 else 0.0
        uniform += int(bool((r == r[0]).all()))
    adv = scores.unsqueeze(-1) * response_mask
    return adv, {**metrics, "algo/groups_all_equal_reward": float(uniform), "algo/groups": float(len(groups))}


def keep_group(rewards: torch.Tensor, cfg: GRPOConfig) -> bool:
    """Dynamic sampling keeps a prompt's group only if its rewards differ (all-equal rewards give zero advantage)."""
    return not cfg.dynamic_sampling or bool((rewards != rewards[0]).any())


def overlong_penalty(lengths: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to overlong_max_len - overlong_buffer tokens, then rising linearly to
    overlong_penalty at overlong_max_len (and staying there beyond)."""
    start = cfg.overlong_max_len - cfg.overlong_buffer
    return ((lengths.float() - start) / cfg.overlong_buffer).clamp(0.0, 1.0) * cfg.overlong_penalty


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                ref_logp: torch.Tensor | None, cfg: GRPOConfig) -> tuple[torch.Tensor, dict]:
    """Per-token clipped surrogate (asymmetric clip ranges, optional dual-clip) + kl_coef * KL to the reference."""
    per_token, metrics = clipped_surrogate(logp, old_logp, advantages, mask, cfg.clip_ratio_low,
                                           cfg.clip_ratio_high, cfg.clip_ratio_c)
    return with_kl_loss(per_token, metrics, logp, ref_logp, mask, cfg.kl_coef, cfg.kl_estimator), metrics
