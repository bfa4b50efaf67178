"""HF config.json as model plugins read it: complete (transformers' defaults), and refused by name where a plugin
cannot map a value exactly."""
from __future__ import annotations

import json
import os
from typing import Any


def read_config_json(path: str) -> dict:
    """A checkpoint directory's config.json (or that file itself), as written."""
    with open(path if path.endswith(".json") else os.path.join(path, "config.json")) as f:
        return json.load(f)


def with_transformers_defaults(raw: dict) -> dict:
    """The config with every key it leaves out set to the default of transformers' config class for its
    ``model_type``, in transformers' own normal form (e.g. ``rope_theta`` inside ``rope_parameters``). Model plugins
    read this one complete dict instead of restating defaults, which drift (transformers' Qwen3 defaults
    ``rope_theta`` to 1e4, Qwen3-MoE ``norm_topk_prob`` to false). A vision-language config's ``text_config`` is
    flattened into it (its ``vision_config`` stays a dict). A model type transformers does not know is returned as it
    is."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") not in CONFIG_MAPPING:   # a plugin for an architecture transformers lacks
        return dict(raw)
    config = AutoConfig.for_model(**raw).to_dict()
    if "text_config" in config:   # a vision-language model: its language model's keys at the top, as published
        return {**config.pop("text_config"), **config}
    return config


def unsupported(family: str, key: str, value: Any, why: str) -> ValueError:
    """The error a model plugin raises for a config value it cannot map exactly: it names the key and the value."""
    return ValueError(f"{family} with {key}={value!r} in config.json is not supported: {why}")


def plain_rope_theta(hf: dict, family: str) -> float:
    """The RoPE base of a family that maps only unscaled RoPE onto Megatron's GPTModel; scaled variants (YaRN,
    linear, dynamic, llama3) are refused by name rather than silently run unscaled."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise unsupported(family, "rope_parameters.rope_type", kind, "only the default (unscaled) RoPE is mapped")
    return float(params["rope_theta"] if "rope_theta" in params else hf["rope_theta"])


def require_silu(hf: dict, family: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported(family, "hidden_act", hf["hidden_act"], "the gated MLP is mapped with SiLU only")
