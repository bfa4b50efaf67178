"""A vision-language model on Megatron: the family's GPTModel (M-RoPE positions) with the family's vision tower in
front of it on the first pipeline stage (``rlcore.specs.VisionSpec``).

The tower is a plain torch module, whole on every tensor-parallel rank: every rank embeds the same images into the
same full-length embeddings, so its gradients agree over TP (they are averaged there all the same, megatron-core's
``average_gradients_across_tp_domain``). Under sequence parallelism the embeddings are gathered whole, the images
placed, then scattered again, which keeps that true. The language model's weights keep GPTModel's names, so its
weight rules, checkpoints, LoRA and the resharder work as for a text model; the tower's are ``vision.<its name>``.
Positions are computed on every pipeline stage from the token ids and the images' grids, per sequence of a packed
row (megatron-core's THD rotary embedding then reads each token's own position).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt import GPTModel

from rlcore.model_parts import TOWER, part_of
from rlcore.multimodal import ImageInputs, concatenated

if TYPE_CHECKING:
    from rlcore.specs import VisionSpec


def tower_shapes(vision: VisionSpec, hf_config: dict) -> dict[str, torch.Size]:
    """The tower's parameters, name -> shape, from a tower built on the meta device (nothing allocated): the weight
    rules of every pipeline stage (also those that do not hold it) and the dry run's count."""
    with torch.device("meta"):
        return {name: p.shape for name, p in vision.encoder(hf_config).named_parameters()}


def tower_parameters(vision: VisionSpec, hf_config: dict, part: str | None = None) -> int:
    """The tower's parameter count; ``part``: of that part only (``rlcore.model_parts``: vision_tower, projector)."""
    return sum(shape.numel() for name, shape in tower_shapes(vision, hf_config).items()
               if part is None or part_of(TOWER + name, vision) == part)


class VisionLanguageGPT(GPTModel):
    """GPTModel whose forward also takes ``images``: one ``ImageInputs`` (or None) per row of ``input_ids``, or per
    sequence of a packed row, in order."""

    def __init__(self, config, transformer_layer_spec, *, vision: VisionSpec, hf_config: dict, **kwargs):
        super().__init__(config, transformer_layer_spec, **kwargs)
        if config.context_parallel_size > 1:
            raise ValueError(f"parallel.cp={config.context_parallel_size} with a vision-language model is not "
                             "supported yet (its M-RoPE positions are not split over context-parallel ranks); use cp=1")
        self.vision_spec, self.hf_config = vision, hf_config
        self.image_token_id = vision.image_token_id(hf_config)
        self.vision: torch.nn.Module | None = None
        if self.pre_process:
            self.vision = vision.encoder(hf_config).to(config.params_dtype)
            for param in self.vision.parameters():
                setattr(param, "average_gradients_across_tp_domain", True)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                images: list[ImageInputs | None] | None = None, packed_seq_params=None, **kwargs):
        """``position_ids`` is ignored: M-RoPE positions come from the tokens and the images' grids."""
        images = images or [None] * (input_ids.shape[0] if packed_seq_params is None else
                                     len(packed_seq_params.cu_seqlens_q) - 1)
        position_ids = self.rotary_positions(input_ids, images, packed_seq_params)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, concatenated(images))
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                               packed_seq_params=packed_seq_params, **kwargs)

    def rotary_positions(self, input_ids: torch.Tensor, images: list[ImageInputs | None],
                         packed_seq_params=None) -> torch.Tensor:
        """[3, rows, length]: each row's (each packed sequence's) positions from its own tokens and images."""
        if packed_seq_params is None:
            sequences = list(input_ids)
        else:
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            sequences = [input_ids[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        if len(sequences) != len(images):
            raise ValueError(f"{len(sequences)} sequences were given images for {len(images)}")
        empty = torch.zeros(0, 3, dtype=torch.long)
        parts = [self.vision_spec.positions(ids, image.grid_thw if image is not None else empty, self.hf_config)
                 for ids, image in zip(sequences, images)]
        return torch.cat(parts, dim=1).unsqueeze(1) if packed_seq_params is not None else torch.stack(parts, dim=1)

    def embed(self, input_ids: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """The first stage's input [s, b, h] (this rank's part of s under sequence parallelism): token embeddings
        with each placeholder's replaced by the tower's embedding of its image patch, rows in order."""
        from megatron.core import tensor_parallel

        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        rows, columns = (input_ids == self.image_token_id).nonzero(as_tuple=True)
        assert self.vision is not None, "the vision tower is on the first pipeline stage only"
        features = (self.vision(images.pixel_values.to(embeddings.dtype), images.grid_thw) if images is not None
                    else embeddings.new_zeros(0, embeddings.shape[-1]))
        if features.shape[0] != len(rows):
            raise ValueError(f"the tokens hold {len(rows)} image placeholders (id {self.image_token_id}) but the "
                             f"images give {features.shape[0]} embeddings: tokens and images were not made together")
        if not len(rows):
            return embeddings
        split = self.config.sequence_parallel
        if split:
            embeddings = tensor_parallel.gather_from_sequence_parallel_region(embeddings,
                                                                              tensor_parallel_output_grad=False)
        embeddings = embeddings.index_put((columns, rows), features.to(embeddings.dtype))
        return tensor_parallel.scatter_to_sequence_parallel_region(embeddings) if split else embeddings
