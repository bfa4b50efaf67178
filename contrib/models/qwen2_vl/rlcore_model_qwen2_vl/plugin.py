"""Qwen2-VL and Qwen2.5-VL: Qwen2's language model with multimodal rotary positions (M-RoPE), and the checkpoint's
own vision tower in front of it (transformers' module, as Megatron-Bridge uses it), whose image embeddings take the
place of the prompt's ``<|image_pad|>`` tokens.

M-RoPE splits each head's rotary frequencies into three sections (``mrope_section``: temporal, height, width); a text
token has the same position in all three, an image's tokens count rows and columns of its merged patch grid from where
the text left off, and the text after it goes on from the largest of them plus one. The positions are computed here
from the tokens and the images' grids (transformers needs ``mm_token_type_ids`` for that, and builds wrong positions
without them: ../shared/notes/vlm-rl.md). Videos are not supported yet."""
from __future__ import annotations

import functools

import torch

from rlcore.errors import ConfigError
from rlcore.hf_config import unsupported
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec, VisionSpec
from rlcore_model_qwen2.plugin import dense_config, gpt_kwargs as qwen2_gpt_kwargs, layer_spec, weight_rules

FAMILIES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen2_vl": "Qwen2-VL"}


def _family(hf: dict) -> str:
    return FAMILIES.get(str(hf.get("model_type")), "Qwen2-VL")


def mrope_section(hf: dict) -> list[int]:
    """The rotary frequencies of each position axis (temporal, height, width); they cover a head's half."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if not section or len(section) != 3 or 2 * sum(section) != head_dim:
        raise unsupported(_family(hf), "rope_parameters.mrope_section", section, f"M-RoPE needs three sections "
                          f"that add up to half the head dimension ({head_dim // 2})")
    return list(section)


def transformer_config(hf: dict, **overrides):
    return dense_config(hf, _family(hf), qkv_bias=True, mrope_section=mrope_section(hf), **overrides)


def gpt_kwargs(hf: dict) -> dict:
    return {**qwen2_gpt_kwargs(hf), "position_embedding_type": "mrope"}


@functools.cache
def _tower_class(model_type: str):
    """transformers' vision tower of the family, returning the merged patch embeddings (one per image token)."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Base)
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Base

    class Tower(Base):
        def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
            return super().forward(pixel_values, grid_thw=grid_thw).pooler_output

    return Tower


def vision_tower(hf: dict) -> torch.nn.Module:
    from transformers import AutoConfig

    if hf.get("model_type") not in FAMILIES:
        raise unsupported("Qwen2-VL", "model_type", hf.get("model_type"), f"this plugin builds {sorted(FAMILIES)}")
    config = AutoConfig.for_model(hf["model_type"], vision_config=hf["vision_config"]).vision_config
    return _tower_class(hf["model_type"])._from_config(config, dtype=torch.float32)


def image_token_id(hf: dict) -> int:
    return int(hf["image_token_id"])


def image_tokens(grid_thw, hf: dict) -> list[int]:
    """<|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>."""
    t, h, w = (int(x) for x in grid_thw)
    count = t * h * w // hf["vision_config"]["spatial_merge_size"] ** 2
    return [hf["vision_start_token_id"], *[hf["image_token_id"]] * count, hf["vision_end_token_id"]]


def reserved_token_ids(hf: dict) -> tuple[int, ...]:
    """The image and video placeholders and the vision markers: a sampled one breaks the next forward's images."""
    return tuple(hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
                 if hf.get(k) is not None)


def mrope_positions(ids: torch.Tensor, grid_thw: torch.Tensor, hf: dict) -> torch.Tensor:
    """[3, len(ids)] rotary positions of one sequence holding the images of ``grid_thw`` in order."""
    merge = hf["vision_config"]["spatial_merge_size"]
    placeholders = (ids == hf["image_token_id"]).nonzero().flatten().tolist()
    positions = torch.empty(3, len(ids), dtype=torch.long)
    position, done, taken = 0, 0, 0       # next text position; tokens placed; placeholders used
    for t, h, w in grid_thw.tolist():
        h, w = h // merge, w // merge
        count = t * h * w
        start = placeholders[taken] if taken < len(placeholders) else len(ids)
        if placeholders[taken: taken + count] != list(range(start, start + count)):
            raise ValueError(f"an image of {count} tokens (grid {t}x{h * merge}x{w * merge}) has no run of {count} "
                             f"placeholder tokens (id {hf['image_token_id']}) at position {start} of the sequence")
        positions[:, done:start] = torch.arange(position, position + start - done)
        position += start - done
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        positions[:, start: start + count] = grid.reshape(3, -1) + position
        position += max(h, w)
        done, taken = start + count, taken + count
    if taken != len(placeholders):
        raise ValueError(f"the sequence holds {len(placeholders)} image placeholder tokens, its images "
                         f"{grid_thw.tolist()} fill {taken}")
    positions[:, done:] = torch.arange(position, position + len(ids) - done)
    return positions


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")   # tiny_hf_config's order


def tiny_files(directory: str, tokenizer, min_pixels: int = 56 * 56, max_pixels: int = 112 * 112) -> int:
    """The task's tokenizer with Qwen's vision tokens as its last four ids, and the processor (transformers' Qwen2-VL
    image processor: images of 56 x 56 to 112 x 112 pixels kept whole, 4 to 16 image tokens each)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    first = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    if [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS] != list(range(first, first + 4)):
        raise ConfigError(f"the task's tokenizer already holds Qwen's vision tokens {VISION_TOKENS} elsewhere: "
                          f"tiny Qwen2.5-VL models need them as its last four ids")
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
                        tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()).save_pretrained(directory)
    return len(tokenizer)


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0) -> dict:
    """A tiny Qwen2.5-VL: the vision placeholders are the last four ids of the vocabulary (image pad, video pad,
    vision start, vision end); a vision tower of two blocks (windowed, then full attention)."""
    if head_dim * num_heads != hidden_size or head_dim % 16 or head_dim < 32:
        raise ConfigError(f"model.tiny: Qwen2.5-VL needs head_dim * num_heads = hidden_size and head_dim a multiple "
                          f"of 16 (its M-RoPE sections, as published: 2:3:3), at least 32 (vLLM's CPU attention), "
                          f"got head_dim={head_dim}, num_heads={num_heads}, hidden_size={hidden_size}")
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]},
        "tie_word_embeddings": False, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id, "torch_dtype": "float32", "use_sliding_window": False,
        "image_token_id": vocab_size - 4, "video_token_id": vocab_size - 3, "vision_start_token_id": vocab_size - 2,
        "vision_end_token_id": vocab_size - 1,
        "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3, "window_size": 56,
                          "fullatt_block_indexes": [1], "out_hidden_size": hidden_size, "tokens_per_second": 2,
                          "hidden_act": "silu"},
    }


def module_name(hf_name: str) -> str:
    """transformers' module path of a published checkpoint's tensor name: it builds the language model under
    ``model.language_model`` and the tower under ``model.visual`` and renames the checkpoint's ``model.*`` and
    ``visual.*`` tensors as it loads them (``lm_head`` stays); names already in that form stay."""
    if hf_name.startswith("visual."):
        return "model." + hf_name
    if hf_name.startswith("model.") and not hf_name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + hf_name[len("model."):]
    return hf_name


VISION = VisionSpec(encoder=vision_tower, hf_prefix="visual.", image_token_id=image_token_id,
                    positions=mrope_positions, image_tokens=image_tokens, reserved_token_ids=reserved_token_ids,
                    tiny_files=tiny_files)
QWEN2_VL = ModelSpec(name="qwen2_vl", hf_architectures=("Qwen2VLForConditionalGeneration",
                                                        "Qwen2_5_VLForConditionalGeneration"),
                     transformer_config=transformer_config, layer_spec=layer_spec, gpt_kwargs=gpt_kwargs,
                     weight_rules=weight_rules, tiny_hf_config=tiny_hf_config, vision=VISION,
                     module_name=module_name)


@hookimpl
def rlcore_models():
    return [QWEN2_VL]
