"""Mixtral (MixtralForCausalLM): config mapping, layer spec and weight rules. Everything model-specific lives here."""
from __future__ import annotations

import logging

import torch.nn.functional as F

from rlcore.convert import FusedGateUp, FusedQKV, Rename
from rlcore.hf_config import plain_rope_theta, require_silu, unsupported
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec

log = logging.getLogger(__name__)


def transformer_config(hf: dict, **overrides):
    """Every layer is sparse. HF routes with a softmax over all experts, then renormalises the top-k weights,
    which equals Megatron's top-k then softmax (``moe_router_pre_softmax=False``); with pre-softmax Megatron skips
    the renormalisation and the outputs differ by several percent."""
    from megatron.core.transformer import TransformerConfig

    require_silu(hf, "Mixtral")
    if hf["sliding_window"] is not None:
        raise unsupported("Mixtral", "sliding_window", hf["sliding_window"], "set it to null in config.json (full "
                          "attention) or use a checkpoint without it")
    if hf["num_experts_per_tok"] == 1:
        raise unsupported("Mixtral", "num_experts_per_tok", 1, "transformers renormalises the top-k weights, so a "
                          "token's one expert gets weight 1.0; megatron-core's top-1 router weights by the softmax "
                          "probability (it refuses top-1 without pre-softmax)")
    if hf["router_jitter_noise"]:
        log.info("Mixtral: router_jitter_noise=%s is not applied (transformers applies it only in training; rlcore "
                 "trains without it, and generation never uses it)", hf["router_jitter_noise"])
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"], num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, **overrides)


def layer_spec(config):
    from rlcore.megatron.attention import gpt_layer_spec

    return gpt_layer_spec(num_experts=config.num_moe_experts)


def gpt_kwargs(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                position_embedding_type="rope", rotary_base=plain_rope_theta(hf, "Mixtral"),
                share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))


def weight_rules(config, hf: dict) -> list:
    L, M = "model.layers.{layer}", "decoder.layers.{layer}"
    expert, hf_expert = f"{M}.mlp.experts.local_experts.{{expert}}", f"{L}.block_sparse_moe.experts.{{expert}}"
    rules = [
        Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_dim=0, vocab=True),
        Rename(f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
        FusedQKV(f"{M}.self_attention.linear_qkv.weight", f"{L}.self_attn.q_proj.weight",
                 f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"),
        Rename(f"{M}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight", tp_dim=1),
        Rename(f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
        Rename(f"{M}.mlp.router.weight", f"{L}.block_sparse_moe.gate.weight"),
        FusedGateUp(f"{expert}.linear_fc1.weight", f"{hf_expert}.w1.weight", f"{hf_expert}.w3.weight"),
        Rename(f"{expert}.linear_fc2.weight", f"{hf_expert}.w2.weight"),
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not hf.get("tie_word_embeddings", False):
        rules.append(Rename("output_layer.weight", "lm_head.weight", tp_dim=0, vocab=True))
    return rules


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0,
                   num_experts: int = 4, experts_per_token: int = 2) -> dict:
    """``ffn_hidden_size`` is the active FFN width per token: each of the ``experts_per_token`` experts gets a
    share, so a tiny MoE costs about what the dense model of the same sizes costs."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size // experts_per_token,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "sliding_window": None,
        "num_local_experts": num_experts, "num_experts_per_tok": experts_per_token, "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0, "output_router_logits": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id, "dtype": "float32",
    }


MIXTRAL = ModelSpec(name="mixtral", hf_architectures=("MixtralForCausalLM",), transformer_config=transformer_config,
                    layer_spec=layer_spec, gpt_kwargs=gpt_kwargs, weight_rules=weight_rules,
                    tiny_hf_config=tiny_hf_config)


@hookimpl
def rlcore_models():
    return [MIXTRAL]
