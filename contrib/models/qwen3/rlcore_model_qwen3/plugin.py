"""Qwen3 dense and Qwen3-MoE: config mapping, layer spec and weight rules. Everything model-specific lives here."""
from __future__ import annotations

import torch.nn.functional as F

from rlcore.convert import FusedGateUp, FusedQKV, Rename
from rlcore.hf_config import plain_rope_theta, require_silu, unsupported
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec


def _refuse_unmapped(hf: dict, family: str, sliding: bool) -> None:
    """Values Megatron's GPTModel cannot reproduce exactly (``hf`` is complete: transformers' defaults filled in).
    ``sliding``: some layer attends through a sliding window in transformers."""
    require_silu(hf, family)
    if hf.get("attention_bias"):
        raise unsupported(family, "attention_bias", True, "transformers adds a bias to q/k/v and o_proj; megatron-core "
                          "has a q/k/v-only bias (add_qkv_bias) or biases on every linear layer, neither of which "
                          "matches")
    if sliding:
        raise unsupported(family, "use_sliding_window", True, f"sliding-window attention (sliding_window="
                          f"{hf.get('sliding_window')}, max_window_layers={hf.get('max_window_layers')}) is not "
                          "implemented; set use_sliding_window to false (full attention, as Qwen3 is published)")


def transformer_config(hf: dict, **overrides):
    """Qwen3 dense. transformers slides the attention window on the layers >= max_window_layers (layer_types)."""
    _refuse_unmapped(hf, "Qwen3", sliding="sliding_attention" in hf["layer_types"])
    return _transformer_config(hf, **overrides)


def _transformer_config(hf: dict, **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
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
    """Qwen3-MoE: every layer sparse; softmax router over all experts, top-k renormalised (norm_topk_prob).
    transformers slides the attention window on every layer once use_sliding_window sets sliding_window."""
    _refuse_unmapped(hf, "Qwen3-MoE", sliding=hf["sliding_window"] is not None)
    for key, every_layer_sparse in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if hf[key] != every_layer_sparse:
            raise unsupported("Qwen3-MoE", key, hf[key], "dense layers among the MoE layers are not mapped yet")
    topk, renormalise = hf["num_experts_per_tok"], hf["norm_topk_prob"]
    if topk == 1 and renormalise:
        raise unsupported("Qwen3-MoE", "num_experts_per_tok", 1, "with norm_topk_prob=true every token's one expert "
                          "gets weight 1.0 in transformers; megatron-core's top-1 router weights by the softmax "
                          "probability (it refuses top-1 without pre-softmax); set norm_topk_prob to false for that")
    return _transformer_config(
        hf, num_moe_experts=_num_experts(hf), moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # top-k then softmax == softmax then renormalised top-k (HF norm_topk_prob=True); without renormalisation
        # HF takes the softmax over all experts first (at top-1 too, which megatron-core asks for)
        moe_router_pre_softmax=not renormalise,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, **overrides)


def gpt_kwargs(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                position_embedding_type="rope", rotary_base=plain_rope_theta(hf, "Qwen3"),
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
