"""Qwen3 dense and Qwen3-MoE: config mapping, layer spec and weight rules. Everything model-specific lives here."""
from __future__ import annotations

import torch.nn.functional as F

from rlcore.convert import FusedGateUp, FusedQKV, Rename
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec


def _rope_theta(hf: dict) -> float:
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e6)))


def transformer_config(hf: dict, **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **overrides,
    )


def layer_spec(config):
    from rlcore.megatron.attention import gpt_layer_spec

    return gpt_layer_spec(num_experts=config.num_moe_experts, qk_layernorm=True)


def _num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf["num_local_experts"]   # transformers 5 writes num_local_experts


def moe_transformer_config(hf: dict, **overrides):
    """Qwen3-MoE: every layer sparse; softmax router over all experts, top-k renormalised (norm_topk_prob)."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                         "supported yet")
    return transformer_config(
        hf, num_moe_experts=_num_experts(hf), moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # top-k then softmax == softmax then renormalised top-k (HF norm_topk_prob=True); without renormalisation
        # HF takes the softmax over all experts first
        moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, **overrides)


def gpt_kwargs(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                position_embedding_type="rope", rotary_base=_rope_theta(hf),
                share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))


def weight_rules(config, hf: dict) -> list:
    L, M = "model.layers.{layer}", "decoder.layers.{layer}"
    if config.num_moe_experts:
        mlp = [
            Rename(f"{M}.mlp.router.weight", f"{L}.mlp.gate.weight"),
            FusedGateUp(f"{M}.mlp.experts.local_experts.{{expert}}.linear_fc1.weight",
                        f"{L}.mlp.experts.{{expert}}.gate_proj.weight", f"{L}.mlp.experts.{{expert}}.up_proj.weight"),
            Rename(f"{M}.mlp.experts.local_experts.{{expert}}.linear_fc2.weight",
                   f"{L}.mlp.experts.{{expert}}.down_proj.weight"),
        ]
    else:
        mlp = [
            FusedGateUp(f"{M}.mlp.linear_fc1.weight", f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"),
            Rename(f"{M}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight", tp_dim=1),
        ]
    rules = [
        Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_dim=0, vocab=True),
        Rename(f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
        FusedQKV(f"{M}.self_attention.linear_qkv.weight", f"{L}.self_attn.q_proj.weight",
                 f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"),
        Rename(f"{M}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
        Rename(f"{M}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight"),
        Rename(f"{M}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight", tp_dim=1),
        Rename(f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
        *mlp,
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not hf.get("tie_word_embeddings", False):
        rules.append(Rename("output_layer.weight", "lm_head.weight", tp_dim=0, vocab=True))
    return rules


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "dtype": "float32",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
    }


def tiny_moe_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0,
                       num_experts: int = 4, experts_per_token: int = 2) -> dict:
    hf = tiny_hf_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_hidden_size,
                        max_position_embeddings, eos_token_id)
    hf.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=num_experts,
              num_experts_per_tok=experts_per_token, moe_intermediate_size=ffn_hidden_size // experts_per_token,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
              output_router_logits=False)
    return hf


QWEN3 = ModelSpec(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), transformer_config=transformer_config,
                  layer_spec=layer_spec, gpt_kwargs=gpt_kwargs, weight_rules=weight_rules,
                  tiny_hf_config=tiny_hf_config)
QWEN3_MOE = ModelSpec(name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",),
                      transformer_config=moe_transformer_config, layer_spec=layer_spec, gpt_kwargs=gpt_kwargs,
                      weight_rules=weight_rules, tiny_hf_config=tiny_moe_hf_config)


@hookimpl
def rlcore_models():
    return [QWEN3, QWEN3_MOE]
