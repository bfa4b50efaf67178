"""Rollout–training mismatch: how far the rollout engine's logprobs are from the trainer's, and an optional
correction of the policy loss for it.

The rollout engine (vLLM, SGLang: other kernels, other precision) samples the responses, but the loss is computed
with the trainer's logprobs of the same weights, and the two disagree a little on every token and a lot on some.
Left alone, that gap biases the gradient and can collapse long runs. Two corrections, both from the ratio
rho = pi_trainer / pi_rollout of the sampled tokens (the trainer's old-policy logprobs over the rollout's):

- truncated importance sampling (TIS): weight each token's loss by min(rho, C), per token or with the sequence's
  product of ratios broadcast to its tokens; the truncation at C bounds the variance;
- rejection: drop whole sequences whose length-normalised ratio (the geometric mean of the token ratios) leaves a
  band [low, high]. The geometric mean, not the product: the product of thousands of ratios near 1 drifts by
  orders of magnitude with length, so one band could not fit short and long responses alike.

Pure functions on [sequences, tokens] tensors; everything returned is detached (the weights are constants of the
loss, as importance weights are), and log-ratios are clamped before ``exp`` so no weight is inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.losses import LOG_RATIO_BOUND, masked, masked_mean

IS_LEVELS = ("none", "token", "sequence")
PREFIX = "rollout_corr/"


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_trainer / pi_rollout) per token, detached, exactly 0 at masked-out positions whatever they hold."""
    return masked(old_logp.detach() - rollout_logp.detach(), mask)


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def sequence_log_ratio(lr: torch.Tensor) -> torch.Tensor:
    """The sequence-level log-ratio: the log of the product of its token ratios."""
    return lr.sum(-1)


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's logprobs are from the trainer's on the sampled tokens. kl_k1 and kl_k3 estimate
    KL(pi_rollout || pi_trainer) (the tokens were drawn from the rollout): k1 = mean(log pi_rollout - log pi_trainer),
    k3 = mean(rho - 1 - log rho), never negative. abs_diff_*: |log pi_trainer - log pi_rollout| over the tokens.
    seq_log_ratio_mean: the mean over sequences of log prod(rho), the log of the sequence-level IS ratio."""
    lr = log_ratio(old_logp, rollout_logp, mask)
    nonempty = (mask != 0).any(-1)
    seq = sequence_log_ratio(lr)[nonempty]
    clamped = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {PREFIX + "kl_k1": masked_mean(-lr, mask).item(),
            PREFIX + "kl_k3": masked_mean(torch.expm1(clamped) - clamped, mask).item(),
            PREFIX + "abs_diff_mean": masked_mean(lr.abs(), mask).item(),
            PREFIX + "abs_diff_max": lr.abs().max().item() if lr.numel() else 0.0,
            PREFIX + "seq_log_ratio_mean": seq.mean().item() if seq.numel() else 0.0}


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights min(rho, threshold): per token (``level`` = token) or the sequence's product
    of ratios on each of its tokens (sequence). 0 at masked-out positions. Metrics: the fraction of tokens whose
    weight was truncated, and the mean weight."""
    lr = log_ratio(old_logp, rollout_logp, mask)
    if level == "sequence":
        lr = sequence_log_ratio(lr).unsqueeze(-1).expand_as(lr)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}; use token or sequence")
    rho = safe_exp(lr)
    weights = masked(rho.clamp(max=threshold), mask)
    return weights, {PREFIX + "tis_clip_frac": masked_mean((rho > threshold).float(), mask).item(),
                     PREFIX + "tis_weight_mean": masked_mean(weights, mask).item()}


def rejection_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, low: float,
                   high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` with every sequence whose geometric-mean ratio exp(mean log rho) is below ``low`` or above
    ``high`` zeroed (0 turns that side off). Metrics: the fractions of (non-empty) sequences and of tokens rejected."""
    lr = log_ratio(old_logp, rollout_logp, mask)
    valid = mask != 0
    geo = safe_exp(sequence_log_ratio(lr) / valid.sum(-1).clamp(min=1))
    reject = torch.zeros_like(geo, dtype=torch.bool)
    if low > 0:
        reject |= geo < low
    if high > 0:
        reject |= geo > high
    reject &= valid.any(-1)
    kept = torch.where(reject.unsqueeze(-1), torch.zeros_like(mask), mask)
    sequences = max(int(valid.any(-1).sum()), 1)
    return kept, {PREFIX + "rejected_seq_frac": float(reject.sum()) / sequences,
                  PREFIX + "rejected_token_frac": masked_mean(reject.unsqueeze(-1).expand_as(mask).float(),
                                                              mask).item()}


@dataclass
class RolloutCorrection:
    """The correction's options, defined once: an algorithm's config dataclass takes them by inheriting this (its
    ``__post_init__`` checks them: ``check_correction_options``, or ``rlcore.losses.check_policy_loss_options``,
    which calls ``check_correction`` without importing this module); they are ``algorithm.rollout_*`` keys. All
    off by default."""
    rollout_is: str = "none"             # correct for the rollout engine's logprobs differing from the trainer's:
                                         # truncated importance weights per token or per sequence (none = off)
    rollout_is_threshold: float = 2.0    # ... truncated at this (>= 1)
    rollout_rs_low: float = 0.0          # reject sequences whose geometric-mean ratio pi_trainer / pi_rollout is
    rollout_rs_high: float = 0.0         # below low or above high (0 = that side off)

    def check_correction(self) -> None:
        """Validate the correction keys (one line naming the key)."""
        from rlcore.errors import ConfigError

        if self.rollout_is not in IS_LEVELS:
            raise ConfigError(f"algorithm.rollout_is = {self.rollout_is!r}: use one of {', '.join(IS_LEVELS)}")
        if not self.rollout_is_threshold >= 1:
            raise ConfigError(f"algorithm.rollout_is_threshold = {self.rollout_is_threshold}: use a number >= 1 (a "
                              f"lower cap would shrink the weight of tokens where both engines agree)")
        if not 0 <= self.rollout_rs_low < 1:
            raise ConfigError(f"algorithm.rollout_rs_low = {self.rollout_rs_low}: use a number in [0, 1) (0 = off)")
        if self.rollout_rs_high and not self.rollout_rs_high > 1:
            raise ConfigError(f"algorithm.rollout_rs_high = {self.rollout_rs_high}: use a number > 1 (or 0 = off)")

    @property
    def asked(self) -> list[str]:
        """The options set away from off, as ``key=value``."""
        return [f"{key}={getattr(self, key)}" for key, off in (("rollout_is", "none"), ("rollout_rs_low", 0.0),
                                                               ("rollout_rs_high", 0.0)) if getattr(self, key) != off]


def correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
               cfg) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The correction an algorithm config asks for (a ``RolloutCorrection``; any other config has none): the
    per-token weights for the policy loss (None when IS is off), the mask to aggregate with (rejected sequences
    zeroed) and the metrics of both. All off: (None, mask, {})."""
    weights: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    if not isinstance(cfg, RolloutCorrection):
        return weights, mask, metrics
    if cfg.rollout_is != "none":
        weights, metrics = tis_weights(old_logp, rollout_logp, mask, cfg.rollout_is, cfg.rollout_is_threshold)
    if cfg.rollout_rs_low > 0 or cfg.rollout_rs_high > 0:
        mask, rejected = rejection_mask(old_logp, rollout_logp, mask, cfg.rollout_rs_low, cfg.rollout_rs_high)
        metrics.update(rejected)
    return weights, mask, metrics


def check_old_logprobs_source(source: str, cfg) -> None:
    """With ``actor.old_logprobs=rollout`` the policy's ratio is taken against the rollout's logprobs already: a
    correction's ratios would all be 1, so asking for one is a mistake worth naming."""
    from rlcore.errors import ConfigError

    if source != "rollout" or not isinstance(cfg, RolloutCorrection):
        return
    asked = cfg.asked
    if asked:
        raise ConfigError(f"actor.old_logprobs=rollout with algorithm.{', algorithm.'.join(asked)}: the policy's "
                          f"ratio is then against the rollout's logprobs, so the correction's ratios would all be "
                          f"1. Use actor.old_logprobs=actor with the correction, or leave the correction off")


def async_default(cfg, config_cls: type) -> str | None:
    """In async mode with ``rollout.max_staleness`` > 0 the samples come from older weights than the learner's, and
    async runs collapse without importance correction (NeMo-RL's finding). By default the old policy is then the
    engine's (``actor.old_logprobs=auto``, rlcore.config.loader.resolve_old_logprobs); a run that asks for the
    trainer's (``actor.old_logprobs=actor``, the decoupled PPO loss: the clipped ratio against the learner's weights
    before the update) gets token-level truncated importance weights pi_learner / pi_behaviour unless it set
    ``algorithm.rollout_is`` itself. Sets it in ``cfg.algorithm`` (every worker binds that) and returns what it
    set."""
    if (cfg.trainer.mode != "async" or cfg.rollout.max_staleness == 0 or "rollout_is" in cfg.algorithm
            or cfg.actor.old_logprobs != "actor" or not issubclass(config_cls, RolloutCorrection)):
        return None
    cfg.algorithm["rollout_is"] = "token"
    return "algorithm.rollout_is=token"


def check_correction_options(cfg) -> None:
    """Validate the correction keys of an algorithm config that has them (one line naming the key)."""
    if isinstance(cfg, RolloutCorrection):
        cfg.check_correction()
