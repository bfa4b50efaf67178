"""Loss aggregation shared by every algorithm.

Megatron runs a mini-batch as several micro-batches and sums their gradients, dividing each micro-batch loss by
the number of micro-batches. ``aggregate`` therefore returns each micro-batch's exact *share* of the mini-batch
loss, computed against mini-batch totals, so the sum over micro-batches equals the loss of the whole mini-batch
regardless of how it is split.

Masked-out positions (padding, failed samples, rejected sequences) may hold anything, NaN or inf included: every
masked reduction here selects with ``torch.where`` instead of multiplying by the mask, because NaN * 0 = NaN.
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# exp() of a log-ratio beyond this is treated as this (e^20 ~ 5e8): far outside any clip range, yet finite, so one
# token whose logprobs disagree wildly (or a garbage value at a padded position) cannot turn the loss into inf/NaN
LOG_RATIO_BOUND = 20.0


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * mask`` where the mask is nonzero and exactly 0 elsewhere, whatever ``x`` holds there. For finite ``x``
    the values equal ``x * mask`` (up to the sign of a zero), so sums over them are the same bits."""
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float,
              total_sequences: float, token_sum_norm: float = 0.0) -> torch.Tensor:
    """token-mean: every response token of the mini-batch weighs the same.
    seq-mean-token-mean: each sequence's mean over its tokens, then the mean over sequences.
    seq-mean-token-sum: each sequence's sum over its tokens, then the mean over sequences.
    seq-mean-token-sum-norm (Dr. GRPO): each sequence's sum over its tokens divided by the constant
    ``token_sum_norm`` (the maximum response length), then the mean over sequences, as in the paper. A constant,
    not this batch's longest response or padded width, so no sequence's weight depends on what it was batched with
    or how the mini-batch was split. verl (0.7.1 on; 0.9's agg_loss) also takes the mean over sequences, but
    divides by its ``loss_scale_factor``, which unless set is the micro-batch's padded width; before 0.7.1 it left
    out the mean over sequences (its scale followed the micro-batch size)."""
    kept = masked(per_token, mask)
    if mode == "token-mean":
        return kept.sum() / max(total_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (kept.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(total_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return kept.sum(-1).sum() / max(total_sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if token_sum_norm <= 0:
            raise ValueError("seq-mean-token-sum-norm needs token_sum_norm > 0, a constant such as the maximum "
                             f"response length (got {token_sum_norm})")
        return kept.sum(-1).sum() / (token_sum_norm * max(total_sequences, 1.0))
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; masked-out entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    return masked((x - mean) * torch.rsqrt(var + eps), mask)


KL_ESTIMATORS = ("k1", "k2", "k3")


def check_policy_loss_options(cfg) -> None:
    """The options every clipped-surrogate algorithm shares (loss_agg_mode, kl_estimator, kl_coef,
    clip_ratio_low/high, clip_ratio_c, and the rollout correction's where the config has them), checked from its
    config's ``__post_init__``; names the key."""
    from rlcore.errors import ConfigError

    if cfg.loss_agg_mode not in AGG_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode = {cfg.loss_agg_mode!r}: use one of {', '.join(AGG_MODES)}")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator = {cfg.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")
    if cfg.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef = {cfg.kl_coef}: must be >= 0")
    if not (0 <= cfg.clip_ratio_low < 1 and cfg.clip_ratio_high >= 0):
        raise ConfigError(f"algorithm.clip_ratio_low/high = {cfg.clip_ratio_low}/{cfg.clip_ratio_high}: "
                          f"need 0 <= low < 1 and high >= 0")
    if cfg.clip_ratio_c and cfg.clip_ratio_c <= 1:
        raise ConfigError(f"algorithm.clip_ratio_c = {cfg.clip_ratio_c}: dual-clip needs c > 1 (or 0 = off)")
    check_correction = getattr(cfg, "check_correction", None)   # a RolloutCorrection's keys: it checks them itself
    if check_correction is not None:                            # (rlcore.rollout_correction builds on this module)
        check_correction()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from the sampled tokens' logprobs (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":   # exp(ref - logp) - (ref - logp) - 1: unbiased and always >= 0
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_low: float, clip_high: float, clip_c: float = 0.0) -> tuple[torch.Tensor, dict]:
    """PPO's per-token clipped surrogate max(-A r, -A clip(r, 1-low, 1+high)), r = pi / pi_old. Dual-clip
    (``clip_c`` = c > 1; 0 = off): where A < 0 the loss is further capped at -A c, so a very large ratio on a bad
    token cannot produce an unbounded update. The log-ratio is clamped to +-LOG_RATIO_BOUND before ``exp``: no
    clip range comes near e^20, so this only touches a token whose ratio would overflow to inf (inf * 0 = NaN
    downstream); past the bound its ratio stops moving, giving a finite loss and no gradient through the ratio."""
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"actor/clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
               "actor/approx_kl_old": masked_mean(0.5 * log_ratio.square(), mask).item()}
    if clip_c:
        capped = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_c), per_token)
        metrics["actor/dual_clip_frac"] = masked_mean((capped < per_token).float(), mask).item()
        per_token = capped
    metrics["actor/pg_loss"] = masked_mean(per_token, mask).item()
    return per_token, metrics


def with_kl_loss(per_token: torch.Tensor, metrics: dict, logp: torch.Tensor, ref_logp: torch.Tensor | None,
                 mask: torch.Tensor, coef: float, estimator: str) -> torch.Tensor:
    """``per_token`` + coef * KL(pi || ref) as a loss term (logged as actor/kl_ref); unchanged when coef is 0."""
    if coef <= 0:
        return per_token
    if ref_logp is None:
        raise RuntimeError("a KL loss term is configured but no reference logprobs were computed")
    kl = kl_estimate(logp, ref_logp, estimator)
    metrics["actor/kl_ref"] = masked_mean(kl, mask).item()
    return per_token + coef * kl


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, real: torch.Tensor, total_pairs: float
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """A reward model's pairwise loss, -log sigmoid(r(chosen) - r(rejected)), summed over this micro-batch's ``real``
    pairs and divided by the mini-batch's ``total_pairs`` (its share of the mini-batch mean); and the micro-batch's
    mean loss, pairwise accuracy and margin."""
    margin = chosen - rejected
    per_pair = -torch.nn.functional.logsigmoid(margin)
    weight = real.to(per_pair.dtype)
    count = max(float(weight.sum()), 1.0)
    seen = lambda x: float((x.detach() * weight).sum()) / count  # noqa: E731
    metrics = {"rm/loss": seen(per_pair), "rm/accuracy": seen((margin > 0).to(weight.dtype)), "rm/margin": seen(margin)}
    return (per_pair * weight).sum() / total_pairs, metrics
