"""PPO's estimators and losses against hand-computed values, with padding and masking edge cases."""
import math

import pytest
import torch

from rlcore.data import Batch
from rlcore.errors import ConfigError
from rlcore_algo_ppo.ppo import (AdaptiveKL, PPOConfig, advantages, explained_variance, gae, last_token_rewards,
                                 policy_loss, value_loss)

# row 0: prompt at column 0, response at 1..3, padding at 4; row 1: a response of length 1; row 2: fully masked
MASK = torch.tensor([[0.0, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])


def test_score_goes_on_the_last_response_token():
    rewards = last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), MASK)
    assert rewards.tolist() == [[0, 0, 0, 1, 0], [2, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_gae_by_hand():
    rewards = last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), MASK)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0], [0.5, 9, 9, 9, 9], [9.0] * 5])   # 9 = outside: ignored
    adv, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    # t=3: 1 - 0.7 = 0.3; t=2: 0.9*0.7 - 0.6 + 0.72*0.3 = 0.246; t=1: 0.9*0.6 - 0.5 + 0.72*0.246 = 0.21712
    assert adv[0].tolist() == pytest.approx([0, 0.21712, 0.246, 0.3, 0])
    assert returns[0].tolist() == pytest.approx([0, 0.71712, 0.846, 1.0, 0])
    assert adv[1].tolist() == pytest.approx([1.5, 0, 0, 0, 0]) and returns[1, 0] == pytest.approx(2.0)
    assert torch.equal(adv[2], torch.zeros(5)) and torch.equal(returns[2], torch.zeros(5))


def test_gae_with_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 1.0, 2.0]])
    values = torch.tensor([[0.5, 0.25, 1.0]])
    adv, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert returns[0].tolist() == pytest.approx([3.0, 3.0, 2.0])
    assert adv[0].tolist() == pytest.approx([2.5, 2.75, 1.0])


def batch_of(scores, values, old=None, ref=None):
    tensors = {"response_mask": MASK, "rewards": torch.tensor(scores), "values": values,
               "group_ids": torch.arange(len(scores))}
    if old is not None:
        tensors.update(old_logprobs=old, ref_logprobs=ref)
    return Batch(tensors)


def test_advantages_store_returns_and_whiten_over_response_tokens():
    batch = batch_of([1.0, 0.0, 5.0], torch.zeros(3, 5))
    adv, metrics = advantages(batch, PPOConfig(gamma=1.0, lam=1.0))
    # values 0, lam 1: returns are the score on every response token; the fully masked row contributes nothing
    assert batch["returns"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    picked = adv[MASK > 0]
    assert float(picked.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(picked.square().mean()) == pytest.approx(1.0, abs=1e-4)   # population std 1
    assert torch.equal(adv * (1 - MASK), torch.zeros(3, 5)), "no advantage outside the response"
    assert metrics["critic/explained_variance"] == pytest.approx(0.0)


def test_kl_penalty_in_the_reward_by_hand():
    old = torch.full((3, 5), -1.0)
    ref = torch.full((3, 5), -1.5)                         # k1 = 0.5 per token
    batch = batch_of([1.0, 0.0, 0.0], torch.zeros(3, 5), old, ref)
    cfg = PPOConfig(gamma=1.0, lam=1.0, norm_adv=False, kl_coef=0.1, kl_estimator="k1")
    adv, metrics = advantages(batch, cfg)
    # token rewards -0.05, -0.05, 0.95: the advantage is the sum of what is left
    assert adv[0].tolist() == pytest.approx([0, 0.85, 0.9, 0.95, 0])
    assert adv[1, 0].item() == pytest.approx(-0.05)
    assert metrics["algo/kl_ref"] == pytest.approx(0.5) and metrics["algo/kl_coef"] == pytest.approx(0.1)


def test_adaptive_kl_coefficient_by_hand():
    control = AdaptiveKL(PPOConfig(kl_coef=0.1, kl_target=0.05, kl_horizon=100))
    control.update(kl=0.1, samples=10)       # KL twice the target: error clipped to +0.2 -> x(1 + 0.2 * 10 / 100)
    assert control.coef == pytest.approx(0.102)
    control.update(kl=0.04, samples=50)      # error -0.2 -> x(1 - 0.2 * 0.5)
    assert control.coef == pytest.approx(0.102 * 0.9)


def test_adaptive_coefficient_persists_across_steps_of_a_run():
    cfg = PPOConfig(kl_coef=0.1, kl_target=0.01, kl_horizon=10)
    old, ref = torch.full((3, 5), -1.0), torch.full((3, 5), -1.5)
    coefs = [advantages(batch_of([1.0, 0.0, 0.0], torch.zeros(3, 5), old, ref), cfg)[1]["algo/kl_coef"]
             for _ in range(3)]
    assert coefs[0] == pytest.approx(0.1) and coefs[1] > coefs[0] and coefs[2] > coefs[1]


def test_clipped_value_loss_by_hand():
    values, old, returns = torch.tensor([[1.5, 0.9]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), PPOConfig(value_clip=0.2))
    # token 0: unclipped (1.5-2)^2 = 0.25, clipped V 1.2 -> 0.64: the larger wins; token 1: 0.81 (within the clip)
    assert loss[0].tolist() == pytest.approx([0.32, 0.405])
    assert metrics["critic/value_clip_frac"] == pytest.approx(0.5)
    plain, _ = value_loss(values, old, returns, torch.ones(1, 2), PPOConfig(value_clip=0.0))
    assert plain[0].tolist() == pytest.approx([0.125, 0.405])


def test_kl_is_a_loss_term_only_when_placed_there():
    logp, ref = torch.zeros(1, 2), torch.full((1, 2), -1.0)
    zero = torch.zeros(1, 2)
    as_reward, _ = policy_loss(logp, logp, zero, torch.ones(1, 2), ref, PPOConfig(kl_coef=0.1))
    as_loss, m = policy_loss(logp, logp, zero, torch.ones(1, 2), ref, PPOConfig(kl_coef=0.1, kl_as="loss",
                                                                               kl_estimator="k3"))
    assert torch.equal(as_reward, zero)
    assert as_loss[0].tolist() == pytest.approx([0.1 * (math.exp(-1) + 1 - 1)] * 2)
    assert m["actor/kl_ref"] == pytest.approx(math.exp(-1))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


@pytest.mark.parametrize("bad", [dict(kl_as="advantage"), dict(lam=1.5), dict(kl_estimator="k4"),
                                 dict(value_clip=-1.0), dict(kl_target=0.1, kl_as="loss", kl_coef=0.1),
                                 dict(clip_ratio_c=0.5), dict(loss_agg_mode="sum")])
def test_invalid_options_name_the_key(bad):
    with pytest.raises(ConfigError, match=f"algorithm.{next(iter(bad))}"):
        PPOConfig(**bad)
