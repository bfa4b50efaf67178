"""What a model family registers (``rlcore.specs`` re-exports it): how to build its Megatron model from an HF config,
its weight rules, and for a vision-language family its vision side."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True)
class VisionSpec:
    """The vision side of a vision-language family, which Megatron's GPTModel lacks: the core builds the
    language model from the family's ``ModelSpec`` as for any other family and adds this (``rlcore.megatron.vision``).

    encoder(hf_config) -> the vision tower (a torch module, on the first pipeline stage, whole on every TP rank);
        ``encoder(pixel_values, grid_thw)`` -> one embedding per image token [tokens, hidden], images in order
    hf_prefix: the checkpoint's name prefix of the tower's weights ("visual."): HF name = prefix + parameter name
    image_token_id(hf_config) -> the placeholder token each image embedding takes the place of
    positions(input_ids [s], grid_thw [images, 3], hf_config) -> one sequence's rotary positions [3, s] (M-RoPE:
        temporal, height, width), given the images it holds in order
    image_tokens(grid_thw [3], hf_config) -> the tokens one image of this patch grid stands as in a prompt (its
        placeholders, as many as its embeddings, and whatever marks them: Qwen's vision start and end)
    reserved_token_ids(hf_config) -> tokens the policy must never sample (placeholders, vision markers)
    tiny_files(directory, tokenizer) -> vocabulary size: for a built-in tiny model, adds the family's vision tokens
        to the task's tokenizer (as the last ids, where ``ModelSpec.tiny_hf_config`` puts them) and writes the
        tokenizer and the family's image processor into ``directory``
    projector_prefix: the name prefix, within the tower, of its projector (the layers that map its features into the
        language model's embedding width: Qwen's ``merger.``), which ``actor.freeze`` treats as a part of its own
    """
    encoder: Callable[[dict], torch.nn.Module]
    hf_prefix: str
    image_token_id: Callable[[dict], int]
    positions: Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]
    image_tokens: Callable[[Sequence[int], dict], list[int]]
    reserved_token_ids: Callable[[dict], tuple[int, ...]]
    tiny_files: Callable[[str, Any], int] | None = None
    projector_prefix: str = "merger."


@dataclass(frozen=True)
class ModelSpec:
    """A model family. ``hf_config`` is the parsed ``config.json`` of an HF checkpoint (a plain dict).

    transformer_config(hf_config, **overrides) -> megatron TransformerConfig
    layer_spec(transformer_config) -> megatron ModuleSpec for one decoder layer, or a TransformerBlockSubmodules
        (this pipeline stage's layer specs) for models whose layers differ, such as leading dense layers before MoE
    gpt_kwargs(hf_config) -> extra GPTModel arguments (vocab size, RoPE base, tied embeddings, ...)
    weight_rules(transformer_config, hf_config) -> list of ``rlcore.convert`` rules (Megatron <-> HF)
    tiny_hf_config(vocab_size, **sizes) -> an HF config dict for built-in tiny models (tests, quickstart)
    vision: a vision-language family's vision tower and positions (``VisionSpec``); None for text-only families
    module_name(hf_name) -> the name transformers gives the module of a checkpoint's tensor name, where it renames a
        checkpoint's tensors as it loads them (Qwen2.5-VL: ``model.*`` -> ``model.language_model.*``); PEFT adapters
        name modules so. None: the checkpoint's names are the modules'
    """
    name: str
    hf_architectures: tuple[str, ...]
    transformer_config: Callable[..., Any]
    layer_spec: Callable[[Any], Any]
    gpt_kwargs: Callable[[dict], dict]
    weight_rules: Callable[[Any, dict], list]
    tiny_hf_config: Callable[..., dict] | None = None
    vision: VisionSpec | None = None
    module_name: Callable[[str], str] | None = None
