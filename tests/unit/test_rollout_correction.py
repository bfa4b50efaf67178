"""Rollout–training mismatch metrics, truncated importance weights and the rejection band, on hand-computed values."""
import math
from dataclasses import dataclass

import pytest
import torch

from rlcore.errors import ConfigError
from rlcore.losses import aggregate, check_policy_loss_options
from rlcore.rollout_correction import RolloutCorrection, correction, mismatch_metrics, rejection_mask, tis_weights

LN2 = math.log(2.0)
# sequence 0: log-ratios (trainer - rollout) ln2, -ln2, ln2 (product of ratios 2, geometric mean 2^(1/3));
# sequence 1: 2 ln2 on its only token (ratio 4), then padding holding garbage the mask must keep out
ROLLOUT = torch.tensor([[0.0, 0.0, 0.0], [0.0, float("nan"), float("inf")]])
OLD = torch.tensor([[LN2, -LN2, LN2], [2 * LN2, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def assert_close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected))


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(OLD, ROLLOUT, MASK)
    assert m["rollout_corr/kl_k1"] == pytest.approx(-(LN2 - LN2 + LN2 + 2 * LN2) / 4)
    k3 = lambda r: r - 1 - math.log(r)   # noqa: E731
    assert m["rollout_corr/kl_k3"] == pytest.approx((k3(2) + k3(0.5) + k3(2) + k3(4)) / 4)
    assert m["rollout_corr/abs_diff_mean"] == pytest.approx(5 * LN2 / 4)
    assert m["rollout_corr/abs_diff_max"] == pytest.approx(2 * LN2)
    assert m["rollout_corr/seq_log_ratio_mean"] == pytest.approx((LN2 + 2 * LN2) / 2)


def test_identical_logprobs_show_no_mismatch():
    m = mismatch_metrics(OLD, OLD, MASK)
    assert all(v == 0.0 for v in m.values()), m


def test_token_level_weights_are_the_truncated_ratios():
    w, m = tis_weights(OLD, ROLLOUT, MASK, "token", threshold=3.0)
    assert_close(w, [[2.0, 0.5, 2.0], [3.0, 0.0, 0.0]])
    assert m["rollout_corr/tis_clip_frac"] == pytest.approx(1 / 4)
    assert m["rollout_corr/tis_weight_mean"] == pytest.approx((2 + 0.5 + 2 + 3) / 4)


def test_sequence_level_weights_are_the_truncated_sequence_ratio_on_every_token():
    w, m = tis_weights(OLD, ROLLOUT, MASK, "sequence", threshold=3.0)
    assert_close(w, [[2.0, 2.0, 2.0], [3.0, 0.0, 0.0]])
    assert m["rollout_corr/tis_clip_frac"] == pytest.approx(1 / 4)     # the one token of the truncated sequence


def test_weights_carry_no_gradient_and_stay_finite_for_extreme_ratios():
    old = torch.tensor([[500.0, -500.0]], requires_grad=True)
    w, _ = tis_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "token", threshold=2.0)
    assert not w.requires_grad
    assert_close(w, [[2.0, math.exp(-20.0)]])
    w, _ = tis_weights(old, torch.zeros(1, 2), torch.ones(1, 2), "sequence", threshold=2.0)
    assert torch.isfinite(w).all()


def test_rejection_band_by_hand():
    # geometric-mean ratios: sequence 0 2^(1/3) ~ 1.26, sequence 1 4
    kept, m = rejection_mask(OLD, ROLLOUT, MASK, low=0.0, high=3.0)
    assert kept.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert m["rollout_corr/rejected_seq_frac"] == 0.5
    assert m["rollout_corr/rejected_token_frac"] == pytest.approx(1 / 4)
    kept, m = rejection_mask(OLD, ROLLOUT, MASK, low=0.5, high=1.2)
    assert kept.tolist() == [[0.0] * 3] * 2
    assert m["rollout_corr/rejected_seq_frac"] == 1.0
    kept, m = rejection_mask(OLD, ROLLOUT, MASK, low=0.5, high=5.0)
    assert torch.equal(kept, MASK) and m["rollout_corr/rejected_seq_frac"] == 0.0


def test_an_empty_sequence_is_never_counted_as_rejected():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    _, m = rejection_mask(OLD, ROLLOUT, mask, low=0.9, high=1.1)    # sequence 0 (1.26) out, sequence 1 empty
    assert m["rollout_corr/rejected_seq_frac"] == 1.0


@dataclass
class Options(RolloutCorrection):
    loss_agg_mode: str = "token-mean"
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 0.0


def test_defaults_correct_nothing():
    weights, kept, metrics = correction(OLD, ROLLOUT, MASK, Options())
    assert weights is None and kept is MASK and metrics == {}


def test_a_config_without_the_options_corrects_nothing():
    weights, kept, metrics = correction(OLD, ROLLOUT, MASK, object())
    assert weights is None and kept is MASK and metrics == {}


def test_both_corrections_together():
    weights, kept, m = correction(OLD, ROLLOUT, MASK, Options(rollout_is="token", rollout_is_threshold=3.0,
                                                              rollout_rs_high=3.0))
    assert_close(weights, [[2.0, 0.5, 2.0], [3.0, 0.0, 0.0]])
    assert kept.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert {"rollout_corr/tis_clip_frac", "rollout_corr/rejected_seq_frac"} <= set(m)


@pytest.mark.parametrize("bad", [dict(rollout_is="seq"), dict(rollout_is_threshold=0.5), dict(rollout_rs_low=1.0),
                                 dict(rollout_rs_low=-0.1), dict(rollout_rs_high=0.9)])
def test_invalid_options_name_the_key_and_value(bad):
    key, value = next(iter(bad.items()))
    with pytest.raises(ConfigError, match=rf"algorithm\.{key} = '?{value}'?:"):
        check_policy_loss_options(Options(**bad))


def test_the_algorithms_accept_the_options():
    grpo = pytest.importorskip("rlcore_algo_grpo.grpo")
    ppo = pytest.importorskip("rlcore_algo_ppo.ppo")
    for cls in (grpo.GRPOConfig, ppo.PPOConfig):
        cls(rollout_is="sequence", rollout_is_threshold=5.0, rollout_rs_low=0.5, rollout_rs_high=2.0)
        with pytest.raises(ConfigError, match="algorithm.rollout_is"):
            cls(rollout_is="tokens")


class RecordingActor:
    """Stands in for MegatronActor.train_step: one micro-batch, the loss and its gradient kept for the test."""

    def train_step(self, share, loss_fn, temperature, entropy):
        logp = share["logp"].clone().requires_grad_(True)
        loss, metrics = loss_fn(logp, share, torch.zeros_like(logp))
        loss.backward()
        self.loss, self.grad = loss.detach(), logp.grad
        return metrics


def actor_train_step(old_logprobs="actor", ref_logprobs=None, **options):
    """ActorWorker.train_step's loss on one micro-batch (no Megatron): the GRPO loss with ``options``, the
    old policy's logprobs from ``old_logprobs`` (actor.old_logprobs)."""
    from types import SimpleNamespace

    from rlcore.workers.worker import ActorWorker
    grpo = pytest.importorskip("rlcore_algo_grpo.plugin")
    worker = object.__new__(ActorWorker)
    worker.algorithm = grpo.GRPO
    worker.algo_cfg = grpo.GRPOConfig(**options)
    worker.cfg = SimpleNamespace(actor=SimpleNamespace(entropy_coef=0.0, old_logprobs=old_logprobs),
                                 rollout=SimpleNamespace(temperature=1.0, max_response_len=3))
    worker.actor = RecordingActor()
    share = dict(logp=OLD + 0.1, old_logprobs=OLD, rollout_logprobs=ROLLOUT, response_mask=MASK,
                 advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]))
    if ref_logprobs is not None:
        share["ref_logprobs"] = ref_logprobs
    metrics = worker.train_step(share, total_tokens=4.0, total_sequences=2.0, single_update=False)
    return worker.actor, metrics, share


def grpo_per_token(share, old="old_logprobs"):
    """GRPO's per-token loss on the same micro-batch, computed directly, with ``share[old]`` as the old policy."""
    from rlcore_algo_grpo.grpo import GRPOConfig, policy_loss
    logp = share["logp"].clone().requires_grad_(True)
    per_token, _ = policy_loss(logp, share[old], share["advantages"], MASK, None, GRPOConfig())
    return logp, per_token


def test_the_actor_logs_the_mismatch_and_by_default_trains_exactly_as_before():
    actor, metrics, share = actor_train_step()
    logp, per_token = grpo_per_token(share)
    expected = aggregate(per_token, MASK, "token-mean", 4.0, 2.0)
    expected.backward()
    assert torch.equal(actor.loss, expected.detach()) and torch.equal(actor.grad, logp.grad)
    assert metrics["rollout_corr/abs_diff_max"] == pytest.approx(2 * LN2)
    assert metrics["rollout/logprob_diff_vs_actor"] == pytest.approx(5 * LN2 / 4)
    assert "rollout_corr/tis_clip_frac" not in metrics


def test_the_actor_weights_its_policy_loss_and_drops_rejected_sequences_over_the_same_totals():
    actor, metrics, share = actor_train_step(rollout_is="token", rollout_is_threshold=3.0, rollout_rs_high=3.0)
    _, per_token = grpo_per_token(share)
    weights = torch.tensor([[2.0, 0.5, 2.0], [3.0, 0.0, 0.0]])
    kept = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])        # sequence 1 (geometric mean 4) rejected
    expected = aggregate(per_token * weights, kept, "token-mean", 4.0, 2.0)   # still over the 4 tokens
    torch.testing.assert_close(actor.loss, expected.detach())
    assert actor.grad[1].abs().sum() == 0
    assert metrics["rollout_corr/rejected_seq_frac"] == 0.5 and metrics["rollout_corr/tis_clip_frac"] == 0.25


def test_the_clip_fractions_count_the_kept_tokens_only():
    """With sequence 1 rejected, actor/clip_frac and dual_clip_frac are over the 3 tokens the loss trains on: every
    ratio is e^0.1, so sequence 0's tokens (A = 1) are clipped at 1 + 0.05 and sequence 1's (A = -1) is dual-clipped
    at 1.05. Over the mask before rejection they were 3/4 and 1/4."""
    _, metrics, _ = actor_train_step(rollout_rs_high=3.0, clip_ratio_high=0.05, clip_ratio_c=1.05)
    assert metrics["rollout_corr/rejected_seq_frac"] == 0.5
    assert metrics["actor/clip_frac"] == 1.0 and metrics["actor/dual_clip_frac"] == 0.0


def test_the_correction_weights_the_surrogate_and_leaves_the_kl_term_alone():
    """As verl: the importance weights multiply the clipped surrogate (through the advantages, in which it is
    positively homogeneous, dual-clip included); the KL-in-loss term keeps weight 1."""
    from rlcore.losses import clipped_surrogate, kl_estimate
    options = dict(rollout_is="token", rollout_is_threshold=3.0, kl_coef=0.5, clip_ratio_c=3.0)
    actor, _, share = actor_train_step(ref_logprobs=OLD - 0.2, **options)
    logp = share["logp"].clone().requires_grad_(True)
    surrogate, _ = clipped_surrogate(logp, share["old_logprobs"], share["advantages"], MASK, 0.2, 0.2, 3.0)
    weights = torch.tensor([[2.0, 0.5, 2.0], [3.0, 0.0, 0.0]])
    kl = kl_estimate(logp, share["ref_logprobs"], "k3")
    expected = aggregate(surrogate * weights + 0.5 * kl, MASK, "token-mean", 4.0, 2.0)
    expected.backward()
    torch.testing.assert_close(actor.loss, expected.detach())
    torch.testing.assert_close(actor.grad, logp.grad)
    weighted_kl = aggregate((surrogate + 0.5 * kl) * weights, MASK, "token-mean", 4.0, 2.0)
    assert abs(float(weighted_kl) - float(actor.loss)) > 1e-3        # the check tells the two apart


def test_the_actor_normalises_dr_grpo_by_the_maximum_response_length():
    actor, _, share = actor_train_step(loss_agg_mode="seq-mean-token-sum-norm")
    _, per_token = grpo_per_token(share)
    expected = aggregate(per_token, MASK, "seq-mean-token-sum-norm", 4.0, 2.0, token_sum_norm=3)
    assert torch.equal(actor.loss, expected.detach())


def test_dr_grpo_aggregation_is_offered_where_it_can_run():
    grpo = pytest.importorskip("rlcore_algo_grpo.grpo")
    ppo = pytest.importorskip("rlcore_algo_ppo.ppo")
    grpo.GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm")
    ppo.PPOConfig(loss_agg_mode="seq-mean-token-sum-norm")      # the critic's value loss passes the constant too


def test_rollout_logprobs_as_the_old_policy():
    """actor.old_logprobs=rollout: the clipped ratio is against the engine's logprobs, and the mismatch is measured
    between them and this pass's (the rollout's garbage past the mask stays out of both)."""
    actor, metrics, share = actor_train_step(old_logprobs="rollout")
    logp, per_token = grpo_per_token(share, old="rollout_logprobs")
    expected = aggregate(per_token, MASK, "token-mean", 4.0, 2.0)
    expected.backward()
    assert torch.equal(actor.loss, expected.detach()) and torch.equal(actor.grad, logp.grad)
    assert not torch.equal(expected, aggregate(grpo_per_token(share)[1], MASK, "token-mean", 4.0, 2.0))
    assert metrics["rollout_corr/abs_diff_max"] == pytest.approx(2 * LN2 + 0.1)       # logp = OLD + 0.1
    assert metrics["rollout/logprob_diff_vs_actor"] == pytest.approx((5 * LN2 - 0.1 + 0.3) / 4)


@pytest.mark.parametrize("correction", [dict(rollout_is="token"), dict(rollout_rs_high=2.0)])
def test_rollout_logprobs_as_the_old_policy_refuse_a_correction(correction):
    from rlcore.rollout_correction import check_old_logprobs_source
    grpo = pytest.importorskip("rlcore_algo_grpo.grpo")
    check_old_logprobs_source("rollout", grpo.GRPOConfig())
    check_old_logprobs_source("actor", grpo.GRPOConfig(**correction))
    with pytest.raises(ConfigError, match=f"actor.old_logprobs=rollout with algorithm.{next(iter(correction))}"):
        check_old_logprobs_source("rollout", grpo.GRPOConfig(**correction))
