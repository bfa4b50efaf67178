"""GRPO advantages and loss against values computed by hand."""
import math

import pytest
import torch

from rlcore.errors import ConfigError
from rlcore.losses import kl_estimate as kl_penalty
from rlcore_algo_grpo.grpo import GRPOConfig, group_advantages, policy_loss


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 6)
    adv, m = group_advantages(rewards, groups, mask, GRPOConfig(eps=0.0))
    # group 0: mean 0.25, unbiased std sqrt(((0.75)^2 + 3*(0.25)^2)/3) = 0.5
    assert adv[:4, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # group 1: mean 3, std sqrt(2)
    assert adv[4:, 0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert torch.equal(adv[:, 2], torch.zeros(6)), "padding positions get no advantage"
    assert adv[:, 0].tolist() == adv[:, 1].tolist(), "every response token of a sample shares its advantage"
    assert m["algo/groups"] == 2 and m["algo/groups_all_equal_reward"] == 0


def test_all_equal_rewards_give_zero_advantage_and_are_counted():
    adv, m = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 2), GRPOConfig())
    assert torch.equal(adv, torch.zeros(4, 2))
    assert m["algo/groups_all_equal_reward"] == 1


def test_without_std_normalisation_advantage_is_centred_reward():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long),
                              torch.ones(4, 1), GRPOConfig(norm_adv_by_std=False))
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_clipped_surrogate_by_hand():
    cfg = GRPOConfig(clip_ratio_low=0.2, clip_ratio_high=0.3)
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5]]))       # ratios 1.5, 0.5, 1.1, 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    per_token, m = policy_loss(logp, old, adv, mask, None, cfg)
    # A>0, r=1.5: max(-1.5, -1.3) = -1.3 (clipped); A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.1: max(1.1, 1.1) = 1.1;                A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert per_token[0].tolist() == pytest.approx([-1.3, -0.5, 1.1, 0.8])
    assert m["actor/clip_frac"] == pytest.approx(0.5)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)


def test_kl_term_is_added_with_its_coefficient():
    cfg = GRPOConfig(kl_coef=0.1, kl_estimator="k1")
    logp = torch.tensor([[0.0]])
    per_token, m = policy_loss(logp, logp, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([[-1.0]]), cfg)
    assert per_token.item() == pytest.approx(0.1 * 1.0)
    assert m["actor/kl_ref"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="reference"):
        policy_loss(logp, logp, torch.zeros(1, 1), torch.ones(1, 1), None, cfg)


@pytest.mark.parametrize("bad", [dict(loss_agg_mode="mean"), dict(kl_estimator="k4"), dict(clip_ratio_low=1.5),
                                 dict(kl_coef=-1.0), dict(clip_ratio_c=0.5), dict(overlong_buffer=4)])
def test_invalid_options_name_the_key(bad):
    with pytest.raises(ConfigError, match=f"algorithm.{next(iter(bad))}"):
        GRPOConfig(**bad)


def test_dual_clip_caps_negative_advantage_losses_by_hand():
    cfg = GRPOConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    logp = torch.log(torch.tensor([[5.0, 5.0, 2.0]]))               # ratios 5, 5, 2
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, m = policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), None, cfg)
    # A<0, ratio 5: max(5, 1.2) = 5 -> capped at 3; A>0, ratio 5: max(-5, -1.2) = -1.2 (no cap); ratio 2: 2 < 3
    assert loss[0].tolist() == pytest.approx([3.0, -1.2, 2.0])
    assert m["actor/dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["actor/pg_loss"] == pytest.approx((3.0 - 1.2 + 2.0) / 3)


def test_overlong_penalty_by_hand():
    # max 8 tokens, buffer 4: no penalty up to 4 tokens, then 0.25 per token, full (0.5 here) at 8
    cfg = GRPOConfig(overlong_buffer=4, overlong_max_len=8, overlong_penalty=0.5, norm_adv_by_std=False)
    mask = torch.zeros(4, 8)
    for i, n in enumerate([1, 4, 6, 8]):                              # a response of length 1 included
        mask[i, :n] = 1
    adv, m = group_advantages(torch.ones(4), torch.tensor([0, 0, 0, 0]), mask, cfg)
    shaped = torch.tensor([1.0, 1.0, 1.0 - 0.25, 1.0 - 0.5])
    assert adv[:, 0].tolist() == pytest.approx((shaped - shaped.mean()).tolist())
    assert m["algo/overlong_penalty_mean"] == pytest.approx((0 + 0 + 0.25 + 0.5) / 4)
    assert torch.equal(adv * (1 - mask), torch.zeros(4, 8)), "no advantage on padding"


def test_a_fully_masked_row_gets_no_advantage():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])                    # the second sample failed: fully masked
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, GRPOConfig())
    assert torch.equal(adv[1], torch.zeros(2)) and adv[0, 0] > 0
