"""PPO math: per-token rewards (the score on the last response token, minus a KL penalty on every token), GAE over
the critic's values, the clipped value loss, and an adaptive KL coefficient."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.data import Batch
from rlcore.errors import ConfigError
from rlcore.losses import (check_policy_loss_options, clipped_surrogate, kl_estimate, masked_mean, masked_whiten,
                           with_kl_loss)
from rlcore.rollout_correction import RolloutCorrection

KL_PLACES = ("reward", "loss")


@dataclass
class PPOConfig(RolloutCorrection):   # + algorithm.rollout_* (rlcore.rollout_correction)
    name: str = "ppo"
    gamma: float = 1.0                   # discount per token
    lam: float = 0.95                    # GAE's lambda: 1 = Monte-Carlo returns minus V, 0 = one-step TD
    norm_adv: bool = True                # whiten advantages over the batch's response tokens
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 0.0            # dual-clip (c > 1; 0 = off)
    value_clip: float = 0.2              # new values kept within +-value_clip of the rollout's (0 = off)
    kl_coef: float = 0.0                 # KL to the reference policy (0 = no reference model); the initial value
                                         # when adaptive
    kl_as: str = "reward"                # reward: -kl_coef * KL on every token's reward; loss: + kl_coef * KL
    kl_estimator: str = "k1"             # k1, k2 or k3
    kl_target: float = 0.0               # > 0: adapt kl_coef toward this KL per token (reward placement only)
    kl_horizon: int = 10000              # adaptive: samples over which kl_coef moves by at most a factor e^0.2
    loss_agg_mode: str = "token-mean"

    def __post_init__(self):
        check_policy_loss_options(self)
        if self.kl_as not in KL_PLACES:
            raise ConfigError(f"algorithm.kl_as = {self.kl_as!r}: use one of {', '.join(KL_PLACES)}")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"algorithm.{key} = {getattr(self, key)}: use a number in [0, 1]")
        for key in ("value_clip", "kl_target"):
            if getattr(self, key) < 0:
                raise ConfigError(f"algorithm.{key} = {getattr(self, key)}: must be >= 0")
        if self.kl_target and (self.kl_as != "reward" or self.kl_coef == 0):
            raise ConfigError(f"algorithm.kl_target = {self.kl_target} adapts the KL reward penalty: it needs "
                              f"algorithm.kl_as=reward (got {self.kl_as!r}) and an initial algorithm.kl_coef > 0 "
                              f"(got {self.kl_coef})")
        if self.kl_horizon < 1:
            raise ConfigError(f"algorithm.kl_horizon = {self.kl_horizon}: use an integer >= 1")


class AdaptiveKL:
    """Ziegler et al. (2019): after each batch, kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(self, cfg: PPOConfig):
        self.coef, self.target, self.horizon = cfg.kl_coef, cfg.kl_target, cfg.kl_horizon

    def update(self, kl: float, samples: int) -> None:
        if self.target:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * samples / self.horizon


def kl_controller(cfg: PPOConfig) -> AdaptiveKL:
    """The run's KL coefficient state, kept with the controller's copy of the config (it lives as long as the run)."""
    return cfg.__dict__.setdefault("_kl_controller", AdaptiveKL(cfg))


def kl_state(cfg: PPOConfig) -> dict:
    """The adaptive KL coefficient, for checkpoints."""
    return {"kl_coef": kl_controller(cfg).coef}


def load_kl_state(cfg: PPOConfig, state: dict) -> None:
    kl_controller(cfg).coef = state["kl_coef"]


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] scores -> [N, S] per-token rewards: the score on each response's last token, 0 elsewhere (and nothing
    for a fully masked row)."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    has_tokens = mask.sum(-1) > 0
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(-1)
    rows = torch.nonzero(has_tokens).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response tokens (the masked span; rows may start at
    different columns). delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last token; A_t = delta_t +
    gamma lam A_{t+1}. Returns (advantages, returns = advantages + values), both 0 outside the mask."""
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0])
    next_advantage = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        inside = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(inside, a, 0.0)
        next_value = torch.where(inside, values[:, t], next_value)
        next_advantage = torch.where(inside, a, next_advantage)
    return advantages, (advantages + values) * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens: 1 is a perfect critic, 0 predicts the mean."""
    residual = returns - values
    var_returns = masked_mean((returns - masked_mean(returns, mask)).square(), mask)
    var_residual = masked_mean((residual - masked_mean(residual, mask)).square(), mask)
    return float(1.0 - var_residual / var_returns) if var_returns > 0 else float("nan")


def advantages(batch: Batch, cfg: PPOConfig) -> tuple[torch.Tensor, dict]:
    """GAE advantages (whitened if norm_adv) from the critic's values; stores the value targets in
    batch["returns"]."""
    mask = batch["response_mask"]
    values = batch["values"] * mask
    rewards = last_token_rewards(batch["rewards"], mask)
    metrics = {}
    if cfg.kl_coef > 0 and cfg.kl_as == "reward":
        control = kl_controller(cfg)
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_estimator) * mask
        rewards = rewards - control.coef * kl
        per_sequence = (kl.sum(-1) / mask.sum(-1).clamp(min=1))[mask.sum(-1) > 0]
        current = float(per_sequence.mean()) if len(per_sequence) else 0.0
        metrics.update({"algo/kl_coef": control.coef, "algo/kl_ref": current})
        control.update(current, len(batch))
    adv, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    batch["returns"] = returns
    metrics["critic/explained_variance"] = explained_variance(values, returns, mask)
    if cfg.norm_adv:
        adv = masked_whiten(adv, mask)
    return adv, metrics


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                ref_logp: torch.Tensor | None, cfg: PPOConfig) -> tuple[torch.Tensor, dict]:
    per_token, metrics = clipped_surrogate(logp, old_logp, advantages, mask, cfg.clip_ratio_low,
                                           cfg.clip_ratio_high, cfg.clip_ratio_c)
    coef = cfg.kl_coef if cfg.kl_as == "loss" else 0.0
    return with_kl_loss(per_token, metrics, logp, ref_logp, mask, coef, cfg.kl_estimator), metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cfg: PPOConfig) -> tuple[torch.Tensor, dict]:
    """0.5 (V - R)^2, or with value clipping 0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old,
    -c, c): the critic cannot move far from the values the advantages were computed with in one batch."""
    error = (values - returns).square()
    metrics = {}
    if cfg.value_clip:
        clipped = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        clipped_error = (clipped - returns).square()
        metrics["critic/value_clip_frac"] = masked_mean((clipped_error > error).float(), mask).item()
        error = torch.maximum(error, clipped_error)
    per_token = 0.5 * error
    metrics["critic/value_loss"] = masked_mean(per_token, mask).item()
    metrics["critic/values_mean"] = masked_mean(values.detach(), mask).item()
    return per_token, metrics
