"""Registers PPO with rlcore."""
from rlcore.hookspecs import hookimpl
from rlcore.specs import Algorithm
from rlcore_algo_ppo.ppo import PPOConfig, advantages, kl_state, load_kl_state, policy_loss, value_loss

PPO = Algorithm(
    name="ppo", config_cls=PPOConfig, advantages=advantages, policy_loss=policy_loss, value_loss=value_loss,
    loss_agg_mode=lambda cfg: cfg.loss_agg_mode, needs_critic=lambda cfg: True,
    needs_reference=lambda cfg: cfg.kl_coef > 0,
    needs_old_logprobs=lambda cfg: cfg.kl_coef > 0 and cfg.kl_as == "reward", state=kl_state,
    load_state=load_kl_state)


@hookimpl
def rlcore_algorithms():
    return [PPO]
