"""Megatron's optimizers: Adam distributed over the data-parallel group (``adam``), and the same with part of its state
held and stepped on the host (``hybrid_adam``, megatron-core's hybrid CPU/GPU optimizer: ``optim.offload_fraction``
of each rank's shard, whole parameters in order, gets a host copy, host gradients and host Adam moments). Both take
the same steps: ``hybrid_adam`` only moves memory (tests/unit/megatron/test_hybrid_optimizer.py)."""
from rlcore.errors import ConfigError
from rlcore.specs import OptimizerSpec


def _config(model_chunks, cfg, **offload):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad,
        bf16=bool(model_chunks[0].config.bf16), use_distributed_optimizer=True, **offload)


def check_adam(cfg, section: str) -> None:
    if cfg.offload_fraction > 0:
        raise ConfigError(f"{section}.offload_fraction = {cfg.offload_fraction:g} needs the hybrid CPU/GPU optimizer: "
                          f"set {section}.name=hybrid_adam (or offload_fraction=0)")


def check_hybrid_adam(cfg, section: str) -> None:
    if cfg.offload_fraction <= 0:
        raise ConfigError(f"{section}.name = hybrid_adam with {section}.offload_fraction = 0 keeps all optimizer "
                          f"state on the device: set {section}.offload_fraction (0 < f <= 1, e.g. 1.0), or use "
                          f"{section}.name=adam")


def build_adam(model_chunks, cfg):
    from megatron.core.optimizer import get_megatron_optimizer

    check_adam(cfg, "optim")
    return get_megatron_optimizer(_config(model_chunks, cfg), model_chunks)


def build_hybrid_adam(model_chunks, cfg):
    from megatron.core.optimizer import get_megatron_optimizer

    check_hybrid_adam(cfg, "optim")
    return get_megatron_optimizer(_config(model_chunks, cfg, optimizer_cpu_offload=True,
                                          optimizer_offload_fraction=cfg.offload_fraction), model_chunks)


SPECS = [OptimizerSpec("adam", build_adam, check_adam),
         OptimizerSpec("hybrid_adam", build_hybrid_adam, check_hybrid_adam)]
