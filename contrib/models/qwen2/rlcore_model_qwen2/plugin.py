"""Qwen2 / Qwen2.5 dense and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): config mapping, layer spec and weight rules.

What sets Qwen2 apart from Qwen3 in Megatron terms: a bias on q, k and v (``add_qkv_bias``; o_proj has none), no
q/k RMSNorm, and ``head_dim`` always hidden_size / num_attention_heads. Qwen2-MoE adds a shared expert whose output
is scaled by ``sigmoid(shared_expert_gate(x))``, which is megatron-core's ``moe_shared_expert_gate``."""
from __future__ import annotations

import torch.nn.functional as F

from rlcore.convert import HF_LAYER, MEGATRON_LAYER, Rename, gated_mlp_rules, llama_style_rules
from rlcore.errors import ConfigError
from rlcore.hf_config import plain_rope_theta, require_silu, unsupported
from rlcore.hookspecs import hookimpl
from rlcore.specs import ModelSpec


def _head_dim(hf: dict, family: str) -> int:
    """transformers takes ``head_dim`` when config.json has one; vLLM's and SGLang's Qwen2 always use hidden_size /
    num_attention_heads, so a different value would train one model and sample from another."""
    derived = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim", derived) != derived:
        raise unsupported(family, "head_dim", hf["head_dim"], f"Qwen2 has head_dim = hidden_size / "
                          f"num_attention_heads = {derived}, and the rollout engines' Qwen2 ignores the key; leave it "
                          "out of config.json")
    return derived


def dense_config(hf: dict, family: str, qkv_bias: bool, **moe_and_overrides):
    """The Qwen2 decoder's TransformerConfig (Qwen2-VL's language model too); ``family`` names it in refusals."""
    from megatron.core.transformer import TransformerConfig

    require_silu(hf, family)
    if "sliding_attention" in hf["layer_types"]:   # transformers slides the window on layers >= max_window_layers
        raise unsupported(family, "use_sliding_window", True, f"sliding-window attention (sliding_window="
                          f"{hf.get('sliding_window')}, max_window_layers={hf.get('max_window_layers')}) is not "
                          "implemented; set use_sliding_window to false (full attention, as Qwen2 is published)")
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=_head_dim(hf, family), normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, **moe_and_overrides)


def transformer_config(hf: dict, **overrides):
    """Qwen2 / Qwen2.5 dense: q/k/v always biased."""
    return dense_config(hf, "Qwen2", qkv_bias=True, **overrides)


def moe_transformer_config(hf: dict, **overrides):
    """Qwen2-MoE: every layer sparse; softmax router over all experts, top-k (renormalised if norm_topk_prob); one
    shared expert of shared_expert_intermediate_size behind a sigmoid gate on every layer."""
    for key, every_layer_sparse in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if hf[key] != every_layer_sparse:
            raise unsupported("Qwen2-MoE", key, hf[key], "dense layers among the MoE layers are not mapped yet")
    topk, renormalise = hf["num_experts_per_tok"], hf["norm_topk_prob"]
    if topk == 1 and renormalise:
        raise unsupported("Qwen2-MoE", "num_experts_per_tok", 1, "with norm_topk_prob=true every token's one expert "
                          "gets weight 1.0 in transformers; megatron-core's top-1 router weights by the softmax "
                          "probability; set norm_topk_prob to false for that")
    return dense_config(
        hf, "Qwen2-MoE", qkv_bias=bool(hf["qkv_bias"]), num_moe_experts=hf["num_experts"], moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # top-k then softmax == softmax then renormalised top-k; without renormalisation the softmax comes first
        moe_router_pre_softmax=not renormalise,
        moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True,   # output * sigmoid(x @ gate_weight.T): HF's shared_expert_gate
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, **overrides)


def layer_spec(config):
    from rlcore.megatron.attention import gpt_layer_spec

    return gpt_layer_spec(num_experts=config.num_moe_experts)


def gpt_kwargs(hf: dict) -> dict:
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                position_embedding_type="rope", rotary_base=plain_rope_theta(hf, "Qwen2"),
                share_embeddings_and_output_weights=bool(hf["tie_word_embeddings"]))


def weight_rules(config, hf: dict) -> list:
    M, L = MEGATRON_LAYER, HF_LAYER
    if config.num_moe_experts:
        mlp = [Rename(f"{M}.mlp.router.weight", f"{L}.mlp.gate.weight"),
               *gated_mlp_rules(f"{M}.mlp.experts.local_experts.{{expert}}", f"{L}.mlp.experts.{{expert}}"),
               *gated_mlp_rules(f"{M}.mlp.shared_experts", f"{L}.mlp.shared_expert"),
               Rename(f"{M}.mlp.shared_experts.gate_weight", f"{L}.mlp.shared_expert_gate.weight")]
    else:
        mlp = gated_mlp_rules(f"{M}.mlp", f"{L}.mlp")
    return llama_style_rules(mlp, qkv_bias=config.add_qkv_bias, tied=hf["tie_word_embeddings"])


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0) -> dict:
    """``head_dim`` must be hidden_size / num_heads (Qwen2 derives it; config.json has no such key)."""
    if head_dim * num_heads != hidden_size:
        raise ConfigError(f"model.tiny: Qwen2 derives head_dim from hidden_size / num_heads, so head_dim={head_dim} "
                          f"does not go with hidden_size={hidden_size}, num_heads={num_heads}; set model.tiny sizes "
                          "where head_dim * num_heads = hidden_size")
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id, "dtype": "float32", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": num_layers, "use_mrope": False,
    }


def tiny_moe_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0,
                       num_experts: int = 4, experts_per_token: int = 2) -> dict:
    """The routed experts share ``ffn_hidden_size`` between the experts a token takes; the shared expert gets as
    much as one routed expert."""
    hf = tiny_hf_config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_hidden_size,
                        max_position_embeddings, eos_token_id)
    del hf["use_mrope"]
    expert = ffn_hidden_size // experts_per_token
    hf.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=num_experts,
              num_experts_per_tok=experts_per_token, moe_intermediate_size=expert,
              shared_expert_intermediate_size=expert, norm_topk_prob=False, decoder_sparse_step=1,
              mlp_only_layers=[], qkv_bias=True, router_aux_loss_coef=0.0, output_router_logits=False)
    return hf


QWEN2 = ModelSpec(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), transformer_config=transformer_config,
                  layer_spec=layer_spec, gpt_kwargs=gpt_kwargs, weight_rules=weight_rules,
                  tiny_hf_config=tiny_hf_config)
QWEN2_MOE = ModelSpec(name="qwen2_moe", hf_architectures=("Qwen2MoeForCausalLM",),
                      transformer_config=moe_transformer_config, layer_spec=layer_spec, gpt_kwargs=gpt_kwargs,
                      weight_rules=weight_rules, tiny_hf_config=tiny_moe_hf_config)


@hookimpl
def rlcore_models():
    return [QWEN2, QWEN2_MOE]
