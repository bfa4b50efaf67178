"""Conformance sweep: Mixtral-8x7B's published config with its sizes scaled down, every key the plugin reads varied
one at a time and together (rlcore_testing.models.sweep_tests): each case matches transformers or is refused by name."""
from rlcore_testing.models import OMIT, published_config, sweep_tests
from rlcore_model_mixtral.plugin import MIXTRAL

BASE = published_config("mixtral-8x7b", vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
CASES = [
    ({"rms_norm_eps": 1e-6}, None),
    ({"rms_norm_eps": 1e-2}, None),
    ({"rope_theta": 1e4}, None),
    ({"rope_theta": OMIT}, None),
    ({"head_dim": 32}, None),                         # published without it: hidden_size / heads
    ({"num_key_value_heads": 4}, None),
    ({"num_key_value_heads": 2}, None),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, None),
    ({"hidden_size": 96}, None),
    ({"intermediate_size": 24}, None),
    ({"num_hidden_layers": 3}, None),
    ({"max_position_embeddings": 128}, None),
    ({"vocab_size": 80}, None),
    ({"tie_word_embeddings": True}, None),
    ({"num_local_experts": 4}, None),
    ({"num_experts_per_tok": 3}, None),
    ({"router_jitter_noise": 0.1}, None),              # training-only noise: logged, not applied
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rms_norm_eps": 1e-6, "rope_theta": OMIT, "head_dim": 32, "num_key_value_heads": 2, "num_hidden_layers": 3,
      "num_local_experts": 4, "num_experts_per_tok": 3, "tie_word_embeddings": True}, None),
]
NOT_VARIED = {"architectures", "model_type", "rope_parameters"}   # rope_parameters: rope_theta's normal form

test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads = sweep_tests(
    {"mixtral": (MIXTRAL, BASE, CASES)}, NOT_VARIED)
