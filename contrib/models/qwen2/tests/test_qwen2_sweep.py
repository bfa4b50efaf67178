"""Conformance sweep: Qwen2.5-0.5B's (tied embeddings), Qwen2.5-7B-Instruct's (untied) and Qwen2-57B-A14B's
published configs with their sizes scaled down, every key the plugin reads varied one at a time and together. Each
case is written as a config.json exactly as given (left-out keys stay out) and must either match transformers
(logits to rlcore_testing.models.LOGIT_TOLERANCE, exact round trip) or be refused with a message naming the key."""
from rlcore_testing.models import OMIT, published_config, sweep_tests
from rlcore_model_qwen2.plugin import QWEN2, QWEN2_MOE

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, max_window_layers=2)
SMALL = published_config("qwen2.5-0.5b", **TINY)                 # tie_word_embeddings: true
LARGE = published_config("qwen2.5-7b-instruct", **TINY)          # tie_word_embeddings: false
MOE = published_config("qwen2-57b-a14b", **TINY, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_experts=16)

COMMON = [   # (case, the key a refusal must name, or None: it must conform)
    ({"rms_norm_eps": 1e-5}, None),
    ({"rms_norm_eps": 1e-2}, None),
    ({"rope_theta": 1e4}, None),
    ({"rope_theta": OMIT}, None),                     # transformers' default (1e4), not the published 1e6
    ({"num_key_value_heads": 2}, None),               # no grouping
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, None),   # head_dim 16
    ({"hidden_size": 96}, None),
    ({"num_hidden_layers": 3}, None),
    ({"max_position_embeddings": 128}, None),
    ({"vocab_size": 80}, None),
    ({"intermediate_size": 80}, None),                # Qwen2-MoE reads it too; every layer is sparse there
    ({"head_dim": 32}, None),                         # = hidden_size / heads, as Qwen2 derives it
    ({"head_dim": 16}, "head_dim"),                   # transformers would take it, vLLM's Qwen2 would not
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, "rope_type"),
]
DENSE_CASES = COMMON + [
    ({"tie_word_embeddings": False}, None),
    ({"use_sliding_window": True, "sliding_window": 4}, None),    # every layer < max_window_layers: full attention
    ({"rms_norm_eps": 1e-5, "rope_theta": OMIT, "num_key_value_heads": 2, "num_hidden_layers": 3,
      "tie_word_embeddings": False, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3}, None),
]
LARGE_CASES = [({"tie_word_embeddings": True}, None), ({"tie_word_embeddings": OMIT}, None),
               ({"rope_theta": OMIT, "num_key_value_heads": 2, "vocab_size": 80}, None)]
MOE_CASES = COMMON + [
    ({"moe_intermediate_size": 24}, None),
    ({"shared_expert_intermediate_size": 40}, None),
    ({"num_experts": 8}, None),
    ({"num_experts_per_tok": 2}, None),
    ({"norm_topk_prob": True}, None),
    ({"norm_topk_prob": OMIT}, None),                 # transformers' default (false), as published
    ({"num_experts_per_tok": 1}, None),               # softmax over all experts, then the top one
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok"),   # renormalised top-1: weight 1.0
    ({"qkv_bias": False}, None),                      # transformers 5's switch; published Qwen2-MoE has biases
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"tie_word_embeddings": True}, None),
    ({"rms_norm_eps": 1e-5, "rope_theta": OMIT, "norm_topk_prob": True, "num_experts_per_tok": 4,
      "num_key_value_heads": 2, "num_hidden_layers": 3, "shared_expert_intermediate_size": 40}, None),
]
# Read, and varied through the keys they derive from (or naming the architecture).
NOT_VARIED = {"architectures", "model_type",
              "layer_types",          # derived from use_sliding_window / sliding_window / max_window_layers
              "rope_parameters"}      # rope_theta's (and rope_scaling's) normal form

SWEEPS = {"qwen2.5-0.5b": (QWEN2, SMALL, DENSE_CASES), "qwen2.5-7b": (QWEN2, LARGE, LARGE_CASES),
          "qwen2-57b-a14b": (QWEN2_MOE, MOE, MOE_CASES)}
test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads = sweep_tests(SWEEPS, NOT_VARIED)
