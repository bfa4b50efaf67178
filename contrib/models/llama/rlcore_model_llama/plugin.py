"""Llama 3.x (LlamaForCausalLM: 3.1, 3.2, 3.3): config mapping, layer spec and weight rules.

Llama 3.1 and later scale RoPE (``rope_type: llama3``): the low frequencies are divided by ``factor``, the high ones
kept, those between interpolated. megatron-core 0.16 implements exactly transformers' ``_compute_llama3_parameters``
(``RotaryEmbedding._apply_scaling``), but GPTModel passes it only ``factor``: ``low_freq_factor`` 1,
``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192 are fixed there. Every published Llama 3.1/3.2/3.3
has those values; another value is refused by name rather than run with megatron's."""
from __future__ import annotations

import torch.nn.functional as F

from rlcore.convert import HF_LAYER, MEGATRON_LAYER, gated_mlp_rules, llama_style_rules
from rlcore.hf_config import require_silu, unsupported
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec

# the llama3 scaling parameters megatron-core's RotaryEmbedding fixes (only the factor reaches it from GPTModel)
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope(hf: dict) -> dict:
    """GPTModel's RoPE arguments: the base, and llama3 scaling when the config asks for it."""
    params = hf["rope_parameters"]     # transformers' normal form of rope_theta and rope_scaling
    kind = params.get("rope_type", "default")
    base = dict(position_embedding_type="rope", rotary_base=float(params["rope_theta"]))
    if kind == "default":
        return base
    if kind != "llama3":
        raise unsupported("Llama", "rope_parameters.rope_type", kind, "only the default RoPE and llama3 scaling are "
                          "mapped onto megatron-core")
    for key, fixed in MEGATRON_LLAMA3_FIXED.items():
        if params[key] != fixed:
            raise unsupported("Llama", f"rope_parameters.{key}", params[key], f"megatron-core's llama3 RoPE scaling "
                              f"fixes {key}={fixed} (only the factor is passed through), as every published Llama 3.x "
                              "has it")
    return {**base, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}


def transformer_config(hf: dict, **overrides):
    from megatron.core.transformer import TransformerConfig

    require_silu(hf, "Llama")
    for key in ("attention_bias", "mlp_bias"):
        if hf[key]:
            raise unsupported("Llama", key, True, "every published Llama 3.x has no biases; megatron-core cannot bias "
                              "exactly the layers transformers biases with it")
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, **overrides)


def layer_spec(config):
    from rlcore.megatron.attention import gpt_layer_spec

    return gpt_layer_spec()


def gpt_kwargs(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"], **rope(hf),
                share_embeddings_and_output_weights=bool(hf["tie_word_embeddings"]))


def weight_rules(config, hf: dict) -> list:
    return llama_style_rules(gated_mlp_rules(f"{MEGATRON_LAYER}.mlp", f"{HF_LAYER}.mlp"), qkv_bias=False,
                             tied=hf["tie_word_embeddings"])


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0) -> dict:
    """A tiny Llama 3.1: llama3 RoPE scaling as published (factor 8), so that the engines' scaled RoPE is what
    every tiny run and the engine check exercise."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "dtype": "float32",
    }


LLAMA = ModelSpec(name="llama", hf_architectures=("LlamaForCausalLM",), transformer_config=transformer_config,
                  layer_spec=layer_spec, gpt_kwargs=gpt_kwargs, weight_rules=weight_rules,
                  tiny_hf_config=tiny_hf_config)


@hookimpl
def rlcore_models():
    return [LLAMA]
