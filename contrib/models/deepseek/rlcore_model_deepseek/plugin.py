"""DeepSeek-V3 and Moonlight (the same architecture at other sizes): config mapping, layer spec and weight rules.

Multi-latent attention (MLA), MoE with shared experts behind a sigmoid router with an expert-score bias (aux-loss-free
balancing, HF ``e_score_correction_bias``) and group-limited routing, dense MLPs in the first
``first_k_dense_replace`` layers, default or YaRN RoPE. Multi-token-prediction layers are left out (RL trains the
main model only). Everything model-specific lives here.
"""
from __future__ import annotations

import dataclasses
import logging

import torch.nn.functional as F

from rlcore.convert import FusedGateUp, Rename
from rlcore.hf_config import require_silu, unsupported
from rlcore.hookspecs import hookimpl
from rlcore.megatron.attention import have_transformer_engine, with_sdpa
from rlcore.specs import ModelSpec

log = logging.getLogger(__name__)


def _rope(hf: dict) -> dict:
    """HF RoPE settings (transformers 5 ``rope_parameters``, or a checkpoint's ``rope_scaling`` + ``rope_theta``) as
    MLATransformerConfig fields. Megatron's MLA always de-interleaves the rotary pairs, as HF's ``rope_interleave``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta)
    mscale, mscale_all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    if kind != "yarn" or params.get("attention_factor") is not None or not params.get("truncate", True) \
            or (mscale_all_dim and not mscale):
        raise unsupported("DeepSeek-V3", "rope_parameters", dict(params), "only the default RoPE and YaRN (with "
                          "factor, beta_fast/slow, mscale and mscale_all_dim, no attention_factor) map onto "
                          "Megatron's MLA")
    original = params.get("original_max_position_embeddings", hf["max_position_embeddings"])
    return dict(rope_type="yarn", rotary_base=theta, original_max_position_embeddings=original,
                rotary_scaling_factor=float(params.get("factor") or hf["max_position_embeddings"] / original),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                # HF scales cos/sin by mscale / mscale_all_dim only when both are set, else by YaRN's own factor
                mscale=float(mscale) if mscale_all_dim else 1.0, mscale_all_dim=float(mscale_all_dim))


def _router(hf: dict) -> dict:
    """Sigmoid scores; the top-k is chosen on score + expert bias among the ``topk_group`` best of ``n_group`` expert
    groups, its weights are the plain scores, renormalised, times ``routed_scaling_factor``. The expert bias stays
    fixed during RL (update rate 0): balancing on a few RL batches would move the routing away from the policy
    being optimised, and it is exported with the weights either way."""
    topk, groups, group_topk = hf["num_experts_per_tok"], hf["n_group"] or 1, hf["topk_group"] or 1
    if hf["norm_topk_prob"] != (topk > 1):
        raise ValueError(f"DeepSeek-V3 with norm_topk_prob={hf['norm_topk_prob']} and num_experts_per_tok="
                         f"{topk} is not supported: megatron-core renormalises the top-k sigmoid scores exactly when "
                         f"it picks more than one expert")
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(f"DeepSeek-V3 group-limited routing needs num_experts_per_tok // topk_group == 2 (got "
                         f"{topk} // {group_topk}): HF ranks a group by its top-2 scores, megatron-core by its top "
                         f"num_experts_per_tok // topk_group")
    return dict(moe_router_topk=topk, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0, moe_router_dtype="fp32",   # HF routes in fp32 too
                moe_router_topk_scaling_factor=float(hf["routed_scaling_factor"]),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None)


def transformer_config(hf: dict, **overrides):
    """MLA (``q_lora_rank`` None = no query compression) with RMSNorm on the compressed query and KV; the first
    ``first_k_dense_replace`` layers dense (``moe_layer_freq`` as a per-layer list), the rest MoE with
    ``n_shared_experts`` folded into one shared-expert MLP, as HF does."""
    from megatron.core.transformer import MLATransformerConfig

    require_silu(hf, "DeepSeek-V3")
    for key, mapped in (("rope_interleave", True), ("attention_bias", False), ("moe_layer_freq", 1)):
        if hf[key] != mapped:
            raise unsupported("DeepSeek-V3", key, hf[key], f"only {key}={mapped!r} is mapped onto megatron-core's MLA")
    layers, dense, shared = hf["num_hidden_layers"], hf["first_k_dense_replace"], hf["n_shared_experts"]
    return MLATransformerConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, **_rope(hf),
        num_moe_experts=hf["n_routed_experts"], moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, **_router(hf),
        **overrides)


# transformers (and DeepSeek's reference code) build the RMSNorms on the compressed query and KV with this epsilon
# whatever rms_norm_eps says (Moonlight publishes 1e-5); megatron-core would use layernorm_epsilon.
LATENT_NORM_EPS = 1e-6


def layer_spec(config):
    """Dense and MoE layers differ, so this is a block spec (the layer specs of this pipeline stage), which GPTModel
    takes in place of a layer spec; without TransformerEngine, megatron-core's local modules with SDPA attention and
    the MLA latent norms at ``LATENT_NORM_EPS``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = have_transformer_engine()
    if te and config.layernorm_epsilon != LATENT_NORM_EPS:   # TE fuses those norms into the up projections
        raise unsupported("DeepSeek-V3 on TransformerEngine", "rms_norm_eps", config.layernorm_epsilon,
                          f"TE's fused MLA latent norms take it, where transformers uses {LATENT_NORM_EPS}")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if te:
        return spec
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = _with_eps(attention.q_layernorm, LATENT_NORM_EPS)
        attention.kv_layernorm = _with_eps(attention.kv_layernorm, LATENT_NORM_EPS)
    return with_sdpa(spec)


def _with_eps(norm: type, eps: float) -> type:
    """``norm`` (a module class megatron builds with an ``eps`` keyword) built with ``eps`` instead."""
    class FixedEpsNorm:
        def __new__(cls, *args, **kwargs):
            return norm(*args, **{**kwargs, "eps": eps})

    return FixedEpsNorm


def gpt_kwargs(hf: dict) -> dict:
    # MLA builds its own (YaRN) rotary embedding from the TransformerConfig; GPTModel's is not used
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
                position_embedding_type="rope",
                share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))


def _gated_mlp(megatron: str, hf: str) -> list:
    return [FusedGateUp(f"{megatron}.linear_fc1.weight", f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            Rename(f"{megatron}.linear_fc2.weight", f"{hf}.down_proj.weight", tp_dim=1)]


def _mlp_rules(layer: int, moe: bool) -> list:
    """One layer's MLP, bound to its layer number (dense and MoE layers have different parameters). Routed experts
    are whole per expert-parallel rank; the shared experts and the dense MLP split over TP like any MLP."""
    M, L = f"decoder.layers.{layer}.mlp", f"model.layers.{layer}.mlp"
    if not moe:
        return _gated_mlp(M, L)
    return [Rename(f"{M}.router.weight", f"{L}.gate.weight"),
            # a buffer, not a parameter: the core maps the buffers that a rule names
            Rename(f"{M}.router.expert_bias", f"{L}.gate.e_score_correction_bias"),
            *_gated_mlp(f"{M}.experts.local_experts.{{expert}}", f"{L}.experts.{{expert}}"),
            *_gated_mlp(f"{M}.shared_experts", f"{L}.shared_experts")]


def weight_rules(config, hf: dict) -> list:
    L, M = "model.layers.{layer}.self_attn", "decoder.layers.{layer}.self_attention"
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    if mtp:
        log.info("DeepSeek-V3: skipping %d multi-token-prediction layer(s) (HF model.layers.%d and up): MTP is off "
                 "in RL training", mtp, config.num_layers)
    if config.q_lora_rank is None:   # Moonlight, V2-Lite style: one query projection
        query = [Rename(f"{M}.linear_q_proj.weight", f"{L}.q_proj.weight", tp_dim=0)]
    else:
        query = [Rename(f"{M}.linear_q_down_proj.weight", f"{L}.q_a_proj.weight", tp_dim=0),
                 Rename(f"{M}.q_layernorm.weight", f"{L}.q_a_layernorm.weight"),
                 Rename(f"{M}.linear_q_up_proj.weight", f"{L}.q_b_proj.weight", tp_dim=0)]
    rules = [
        Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_dim=0, vocab=True),
        Rename("decoder.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight"),
        *query,
        # the local spec's down projections are column-parallel: split on their output, gathered in forward
        Rename(f"{M}.linear_kv_down_proj.weight", f"{L}.kv_a_proj_with_mqa.weight", tp_dim=0),
        Rename(f"{M}.kv_layernorm.weight", f"{L}.kv_a_layernorm.weight"),
        Rename(f"{M}.linear_kv_up_proj.weight", f"{L}.kv_b_proj.weight", tp_dim=0),
        Rename(f"{M}.linear_proj.weight", f"{L}.o_proj.weight", tp_dim=1),
        Rename("decoder.layers.{layer}.pre_mlp_layernorm.weight",
               "model.layers.{layer}.post_attention_layernorm.weight"),
        *(r for i, moe in enumerate(config.moe_layer_freq) for r in _mlp_rules(i, bool(moe))),
        Rename("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not hf.get("tie_word_embeddings", False):
        rules.append(Rename("output_layer.weight", "lm_head.weight", tp_dim=0, vocab=True))
    return rules


def tiny_hf_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, ffn_hidden_size: int, max_position_embeddings: int, eos_token_id: int = 0, *,
                   num_experts: int = 8, experts_per_token: int = 2, n_group: int = 2, topk_group: int = 1,
                   q_lora_rank: int | None = -1, yarn_factor: float | None = None) -> dict:
    """A DeepSeek-V3 config with the first layer dense and the rest MoE (one shared expert). ``head_dim`` is the
    no-RoPE query/key and the value head size, the RoPE part is half of it; MLA has no KV head groups, so
    ``num_kv_heads`` is ignored. ``q_lora_rank``: -1 = hidden_size // 2, None = no query compression."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn_factor:
        rope = {**rope, "rope_type": "yarn", "factor": yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": int(max_position_embeddings // yarn_factor),
                "mscale": 1.0, "mscale_all_dim": 1.0}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": ffn_hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
        "q_lora_rank": hidden_size // 2 if q_lora_rank == -1 else q_lora_rank, "kv_lora_rank": hidden_size // 2,
        "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": num_experts, "n_shared_experts": 1,
        "num_experts_per_tok": experts_per_token, "moe_intermediate_size": ffn_hidden_size // experts_per_token,
        "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",   # in real configs; vLLM needs them
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_position_embeddings,
        "rope_parameters": rope, "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "dtype": "float32",
    }


def tiny_moonlight_hf_config(*args, **kwargs) -> dict:
    """Moonlight's shape: no query compression, a single expert group, plain RoPE."""
    return tiny_hf_config(*args, **{"q_lora_rank": None, "n_group": 1, "topk_group": 1, **kwargs})


DEEPSEEK_V3 = ModelSpec(name="deepseek_v3", hf_architectures=("DeepseekV3ForCausalLM",),
                        transformer_config=transformer_config, layer_spec=layer_spec, gpt_kwargs=gpt_kwargs,
                        weight_rules=weight_rules, tiny_hf_config=tiny_hf_config)
MOONLIGHT = dataclasses.replace(DEEPSEEK_V3, name="moonlight", tiny_hf_config=tiny_moonlight_hf_config)


@hookimpl
def rlcore_models():
    return [DEEPSEEK_V3, MOONLIGHT]
