"""What ``actor.lora`` asks for: which of megatron-core's linears get adapters, their rank, scale and dropout
(``LoRAConfig``), read from the config section (``lora_config``). Nothing here imports the training backend: the
config's own checks use it."""
from __future__ import annotations

from dataclasses import dataclass

from rlcore.errors import ConfigError

# megatron-core's names of a dense decoder layer's linears
DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# multi-latent attention's projections (DeepSeek-V3, Moonlight): in megatron-core's local spec all column-parallel,
# the down projections too (their output split over TP and gathered by the attention), so ColumnLoRA's layout holds;
# linear_q_proj replaces the query down/up pair where the model has no query compression (q_lora_rank None)
MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
TARGETS = DENSE_TARGETS + MLA_TARGETS


@dataclass(frozen=True)
class LoRAConfig:
    """Which linears get adapters, and their rank, scale (alpha / rank, PEFT's) and input dropout. ``seed``: the
    adapters' initialisation (combined with each layer's model-wide name)."""
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DENSE_TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"LoRA rank={self.rank!r}: must be a positive integer (e.g. 16)")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r}: must be positive (the scale is alpha / rank; e.g. 2 x rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout={self.dropout!r}: must be in [0, 1)")
        if not self.target_modules:
            raise ValueError(f"LoRA target_modules is empty: name some of {', '.join(TARGETS)}")
        for name in self.target_modules:
            if name == "router":
                raise ValueError("LoRA target_modules names 'router': the MoE router is never adapted; remove it")
            if name not in TARGETS:
                raise ValueError(f"LoRA target_modules names {name!r}, which is not a megatron-core linear rlcore "
                                 f"adapts; choose from {', '.join(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_config(section, seed: int = 0) -> LoRAConfig | None:
    """``actor.lora`` as the adapters' ``LoRAConfig`` (None when rank is 0: off), initialised from ``seed``; a bad
    value is a ConfigError naming the key."""
    if section.rank == 0:
        return None
    try:
        return LoRAConfig(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                          target_modules=tuple(section.target_modules), seed=seed)
    except ValueError as e:   # LoRAConfig's messages start "LoRA <key>"
        raise ConfigError(str(e).replace("LoRA ", "actor.lora.", 1)) from e
