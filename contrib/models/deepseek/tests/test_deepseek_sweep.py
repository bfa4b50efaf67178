"""Conformance sweep: DeepSeek-V3's and Moonlight-16B-A3B's published configs with their sizes scaled down, every key
the plugin reads varied one at a time and together (rlcore_testing.models.sweep_tests): each case matches transformers
or is refused by name. Moonlight publishes rms_norm_eps 1e-5, which transformers does not apply to the MLA latent
norms."""
from rlcore_testing.models import OMIT, published_config, sweep_tests
from rlcore_model_deepseek.plugin import DEEPSEEK_V3, MOONLIGHT

MLA = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, first_k_dense_replace=1)
V3 = published_config("deepseek-v3", **MLA, q_lora_rank=32, n_routed_experts=16, max_position_embeddings=160)
V3["rope_scaling"] = {**V3["rope_scaling"], "original_max_position_embeddings": 4}     # factor 40, as published
MOON = published_config("moonlight-16b-a3b", **MLA, n_routed_experts=12, max_position_embeddings=64)
YARN = V3["rope_scaling"]

V3_CASES = [
    ({"rms_norm_eps": 1e-5}, None),
    ({"rms_norm_eps": 1e-2}, None),
    ({"q_lora_rank": None}, None),
    ({"q_lora_rank": 16}, None),
    ({"kv_lora_rank": 16}, None),
    ({"qk_nope_head_dim": 8}, None),
    ({"qk_rope_head_dim": 4}, None),
    ({"v_head_dim": 8}, None),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, None),
    ({"hidden_size": 96}, None),
    ({"intermediate_size": 80}, None),
    ({"moe_intermediate_size": 24}, None),
    ({"num_hidden_layers": 4}, None),
    ({"vocab_size": 80}, None),
    ({"tie_word_embeddings": True}, None),
    ({"n_routed_experts": 8, "n_group": 4}, None),    # transformers ranks a group by its top 2: 2+ per group
    ({"n_shared_experts": 2}, None),
    ({"first_k_dense_replace": 0}, None),
    ({"first_k_dense_replace": 2}, None),
    ({"num_experts_per_tok": 4, "topk_group": 2}, None),
    ({"n_group": 4}, None),
    ({"n_group": 1, "topk_group": 1}, None),
    ({"routed_scaling_factor": 1.0}, None),
    ({"norm_topk_prob": OMIT}, None),
    ({"num_nextn_predict_layers": 0}, None),
    ({"max_position_embeddings": 320}, None),
    ({"rope_theta": 5e4}, None),
    ({"rope_scaling": None}, None),
    ({"rope_scaling": None, "rope_theta": OMIT}, None),
    ({"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.4}}, None),
    ({"rope_scaling": {**YARN, "beta_fast": 16, "beta_slow": 2}}, None),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "rope_parameters"),
    ({"num_experts_per_tok": 4}, "num_experts_per_tok"),      # groups ranked by their top 2, as in transformers
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"attention_bias": True}, "attention_bias"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rms_norm_eps": 1e-5, "q_lora_rank": 16, "kv_lora_rank": 16, "n_shared_experts": 2, "first_k_dense_replace": 2,
      "num_hidden_layers": 4, "num_experts_per_tok": 4, "topk_group": 2, "routed_scaling_factor": 1.0,
      "tie_word_embeddings": True}, None),
]
MOON_CASES = [
    ({}, None),                                       # as published: rms_norm_eps 1e-5
    ({"rms_norm_eps": 1e-6}, None),
    ({"q_lora_rank": 32}, None),
    ({"n_shared_experts": 1}, None),
    ({"num_experts_per_tok": 2}, None),
    ({"n_routed_experts": 6}, None),
    ({"first_k_dense_replace": 0}, None),
    ({"rope_theta": OMIT}, None),
    ({"routed_scaling_factor": 1.0}, None),
    ({"num_experts_per_tok": 1}, "norm_topk_prob"),     # top-1 is not renormalised by megatron-core
]
# Read but not varied on their own: naming the architecture; rope_parameters is rope_theta/rope_scaling's normal form.
NOT_VARIED = {"architectures", "model_type", "rope_parameters", "num_mtp_layers"}

test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads = sweep_tests(
    {"deepseek_v3": (DEEPSEEK_V3, V3, V3_CASES), "moonlight": (MOONLIGHT, MOON, MOON_CASES)}, NOT_VARIED)
