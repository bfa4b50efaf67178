"""Registers GRPO with rlcore."""
from rlcore.hookspecs import hookimpl
from rlcore.specs import Algorithm
from rlcore_algo_grpo.grpo import GRPOConfig, group_advantages, policy_loss

GRPO = Algorithm(name="grpo", config_cls=GRPOConfig, advantages=group_advantages, policy_loss=policy_loss,
                 loss_agg_mode=lambda cfg: cfg.loss_agg_mode, needs_reference=lambda cfg: cfg.kl_coef > 0)


@hookimpl
def rlcore_algorithms():
    return [GRPO]
