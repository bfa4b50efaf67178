"""Images in prompts: a task row's images (verl's ``images`` column: PIL images, ``{"bytes", "path"}`` structs, paths
or raw bytes) and ``<image>`` tags in its text become the trained model's tokens (each image as its placeholders,
``VisionSpec.image_tokens``) and the processor's pixels (``ImageInputs``), which ride on the trajectory and the
batch's per-row metadata (``IMAGE_INPUTS``) to the learner; the engine gets the decoded images (``IMAGES``)."""
from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from rlcore.errors import RlcoreError

if TYPE_CHECKING:
    from rlcore.specs import VisionSpec

IMAGES = "images"               # a row's / trajectory's images (decoded to PIL once the prompt is encoded)
IMAGE_INPUTS = "image_inputs"   # a trajectory's / batch row's ``ImageInputs``
IMAGE_TAG = "<image>"           # where each image goes in a prompt's text (verl's convention), in order


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


def decode_image(image: Any, where: str):
    """A PIL image (RGB) from what a row may hold; one line naming ``where`` when it cannot be read."""
    from PIL import Image

    try:
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        if isinstance(image, dict):      # verl's / HF datasets' Image struct: bytes when embedded, else a path
            image = image.get("bytes") or image.get("path")
        if isinstance(image, (bytes, bytearray)):
            return Image.open(io.BytesIO(image)).convert("RGB")
        if isinstance(image, str):
            return Image.open(image).convert("RGB")
    except Exception as e:   # PIL raises several kinds for unreadable data
        raise RlcoreError(f"{where}: the image cannot be decoded ({type(e).__name__}: {e}); give PNG/JPEG bytes, a "
                          f"path or a PIL image") from None
    raise RlcoreError(f"{where}: an image is a {type(image).__name__}; give PNG/JPEG bytes, a {{bytes, path}} "
                      f"struct, a path or a PIL image")


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def copy_processor_files(source: str, target: str) -> None:
    """A vision-language checkpoint's processor files (image processor settings, chat template) from ``source`` to
    an export in ``target``, so that transformers and the engines read the images of the trained model as the run
    did."""
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


class ImagePrompts:
    """Encodes prompts that hold images for a vision-language model, with the checkpoint's own image processor
    (its ``preprocessor_config.json``: min/max pixels as the model directory says)."""

    def __init__(self, model_path: str, vision: VisionSpec, hf_config: dict, tokenizer, limit: int):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.vision, self.hf_config, self.tokenizer, self.limit = vision, hf_config, tokenizer, limit
        self.reserved = tuple(vision.reserved_token_ids(hf_config))

    def encode(self, text: str, images: Sequence[Any], where: str) -> tuple[list[int], list, ImageInputs]:
        """(the trained model's tokens, the decoded images, the processor's pixels) of a prompt whose text holds one
        ``<image>`` tag per image (one or more: a prompt without images is plain text)."""
        pieces = text.split(IMAGE_TAG)
        if len(pieces) - 1 != len(images):
            raise RlcoreError(f"{where}: the prompt holds {len(pieces) - 1} {IMAGE_TAG} tag(s) for {len(images)} "
                              f"image(s); put one {IMAGE_TAG} where each image goes")
        if len(images) > self.limit:
            raise RlcoreError(f"{where}: {len(images)} images, more than rollout.limit_images={self.limit}; raise "
                              f"it (the engine reserves encoder memory for that many) or leave the row out")
        decoded = [decode_image(image, where) for image in images]
        processed = self.processor(images=decoded, return_tensors="pt")
        inputs = ImageInputs(processed["pixel_values"], processed["image_grid_thw"])
        tokens = self._text(pieces[0])
        for grid, piece in zip(inputs.grid_thw.tolist(), pieces[1:]):
            tokens += self.vision.image_tokens(grid, self.hf_config) + self._text(piece)
        return tokens, decoded, inputs

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def transformers_inputs(self, input_ids: torch.Tensor, images: Sequence[ImageInputs | None]) -> dict:
        """What transformers' model of the family takes besides ``input_ids`` for rows holding ``images`` (one entry
        per row): the pixels, the grids and ``mm_token_type_ids`` (1 at image placeholders), without which it builds
        wrong rotary positions."""
        present = concatenated(list(images))
        if present is None:
            return {}
        image_token = self.vision.image_token_id(self.hf_config)
        return {"pixel_values": present.pixel_values, "image_grid_thw": present.grid_thw,
                "mm_token_type_ids": (input_ids == image_token).int()}

