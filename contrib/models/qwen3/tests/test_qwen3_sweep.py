"""Conformance sweep: Qwen3-8B's and Qwen3-30B-A3B's published configs with their sizes scaled down, every key the
plugin reads varied one at a time and together. Each case is written as a config.json exactly as given (left-out keys
stay out) and must either match transformers (logits to rlcore_testing.models.LOGIT_TOLERANCE, exact round trip) or be
refused with a message naming the key."""
from rlcore_testing.models import OMIT, published_config, sweep_tests
from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
DENSE = published_config("qwen3-8b", **TINY, max_window_layers=2)
MOE = published_config("qwen3-30b-a3b", **TINY, moe_intermediate_size=32, num_experts=16)

COMMON = [   # (case, the key a refusal must name, or None: it must conform)
    ({"rms_norm_eps": 1e-5}, None),
    ({"rms_norm_eps": 1e-2}, None),
    ({"rope_theta": 5e5}, None),
    ({"rope_theta": OMIT}, None),                     # transformers' default (1e4), not the published 1e6
    ({"head_dim": 16}, None),                         # = hidden_size / heads
    ({"num_key_value_heads": 4}, None),               # no grouping
    ({"num_key_value_heads": 2}, None),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, None),
    ({"hidden_size": 96}, None),
    ({"num_hidden_layers": 3}, None),
    ({"max_position_embeddings": 128}, None),
    ({"vocab_size": 80}, None),
    ({"intermediate_size": 80}, None),                # Qwen3-MoE reads it too; every layer is sparse there
    ({"tie_word_embeddings": True}, None),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, "rope_type"),
]
DENSE_CASES = COMMON + [
    ({"head_dim": OMIT}, None),                       # transformers' default (128), not hidden_size / heads
    ({"use_sliding_window": True, "sliding_window": 4}, None),    # every layer < max_window_layers: full attention
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "use_sliding_window"),
    ({"rms_norm_eps": 1e-5, "rope_theta": OMIT, "head_dim": 16, "num_key_value_heads": 2, "num_hidden_layers": 3,
      "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3}, None),
]
MOE_CASES = COMMON + [
    ({"head_dim": OMIT}, None),                       # Qwen3-MoE: hidden_size / heads
    ({"moe_intermediate_size": 24}, None),
    ({"num_experts": 8}, None),
    ({"num_experts_per_tok": 2}, None),
    ({"norm_topk_prob": False}, None),
    ({"norm_topk_prob": OMIT}, None),                 # transformers' default (false), not the published true
    ({"num_experts_per_tok": 1, "norm_topk_prob": False}, None),  # softmax over all experts, then the top one
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),          # renormalised top-1: weight 1.0
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
    ({"rms_norm_eps": 1e-5, "rope_theta": OMIT, "norm_topk_prob": OMIT, "num_experts_per_tok": 4,
      "num_key_value_heads": 2, "num_hidden_layers": 3, "tie_word_embeddings": True}, None),
]
# Read, and varied through the keys they derive from (or naming the architecture).
NOT_VARIED = {"architectures", "model_type",
              "num_local_experts",    # num_experts' normal form in transformers 5
              "layer_types",          # derived from use_sliding_window / max_window_layers
              "rope_parameters"}      # rope_theta's normal form

SWEEPS = {"qwen3": (QWEN3, DENSE, DENSE_CASES), "qwen3_moe": (QWEN3_MOE, MOE, MOE_CASES)}
test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads = sweep_tests(SWEEPS, NOT_VARIED)
