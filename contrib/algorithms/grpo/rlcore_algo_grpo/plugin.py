"""Registers GRPO with rlcore."""
from rlcore.hookspecs import hookimpl
from rlcore.specs import Algorithm
from rlcore_algo_grpo.grpo import GRPOConfig, group_advantages, keep_group, policy_loss

GRPO = Algorithm(
    name="grpo", config_cls=GRPOConfig,
    advantages=lambda batch, cfg: group_advantages(batch["rewards"], batch["group_ids"], batch["response_mask"], cfg),
    policy_loss=policy_loss, loss_agg_mode=lambda cfg: cfg.loss_agg_mode, needs_reference=lambda cfg: cfg.kl_coef > 0,
    keep_group=keep_group)


@hookimpl
def rlcore_algorithms():
    return [GRPO]
