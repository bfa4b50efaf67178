"""Megatron's optimizer (Adam, distributed over the data-parallel group)."""
from rlcore.specs import OptimizerSpec


def build_adam(model_chunks, cfg):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = bool(model_chunks[0].config.bf16)
    return get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, bf16=bf16,
        use_distributed_optimizer=True, optimizer_cpu_offload=cfg.offload_fraction > 0,
        optimizer_offload_fraction=cfg.offload_fraction), model_chunks)


SPECS = [OptimizerSpec("adam", build_adam)]
