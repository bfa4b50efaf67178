"""The parts of a model that ``actor.freeze`` names: a vision-language model's vision tower, its projector (the
tower's last layers, which map image features into the language model's width) and the language model. A frozen
part keeps its loaded weights: it gets no gradients and no optimizer state (Megatron DDP and the optimizer skip
parameters that do not require them), while the backward pass still runs through it to the parts that train."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

    from rlcore.model_spec import VisionSpec

PARTS = ("vision_tower", "projector", "language_model")
VISION_PARTS = PARTS[:2]
TOWER = "vision."          # the Megatron model's name prefix of the tower's parameters (rlcore.megatron.vision)


def part_of(name: str, vision: VisionSpec | None) -> str:
    """The part a Megatron parameter name (this rank's, or a tower name with ``TOWER``) belongs to."""
    if vision is not None and name.startswith(TOWER):
        return "projector" if name[len(TOWER):].startswith(vision.projector_prefix) else "vision_tower"
    return "language_model"


def freeze(model: torch.nn.Module, parts: Iterable[str], vision: VisionSpec | None) -> None:
    """Stop gradients to ``parts`` of ``model`` (this rank's; before DDP and the optimizer are built over it)."""
    parts = set(parts)
    for name, param in model.named_parameters():
        if part_of(name, vision) in parts:
            param.requires_grad_(False)
