"""What a sample's images are to the trained model: the processor's output, carried per sample beside its tokens
(on the trajectory, then in the batch's per-row metadata under ``IMAGES``) to the learner's forward passes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

IMAGES = "images"     # the Batch.meta / Trajectory.metadata key of a sample's ``ImageInputs``


@dataclass
class ImageInputs:
    """One sample's images in order, as the model's image processor made them: ``pixel_values`` [patches, features]
    (every image's patches, one after the other) and ``grid_thw`` [images, 3] (each image's temporal, height and
    width patch counts). The sample's tokens hold each image's placeholder tokens, as many as its embeddings."""
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def __post_init__(self):
        patches = int(self.grid_thw.prod(-1).sum()) if len(self.grid_thw) else 0
        if self.grid_thw.dim() != 2 or self.grid_thw.shape[-1] != 3 or patches != self.pixel_values.shape[0]:
            raise ValueError(f"images: grid_thw {tuple(self.grid_thw.shape)} gives {patches} patches, pixel_values "
                             f"has {self.pixel_values.shape[0]}: they are not one processor output")


def concatenated(samples: list[ImageInputs | None]) -> ImageInputs | None:
    """The images of several samples in order (a micro-batch's rows), None when none has any."""
    present = [s for s in samples if s is not None and len(s.grid_thw)]
    if not present:
        return None
    return ImageInputs(torch.cat([s.pixel_values for s in present]), torch.cat([s.grid_thw for s in present]))
