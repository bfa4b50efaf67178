"""Conformance sweep: Llama-3.1-8B's (untied, llama3 RoPE factor 8) and Llama-3.2-1B's (tied, explicit head_dim,
factor 32) published configs with their sizes scaled down, every key the plugin reads varied one at a time and
together: each case matches transformers (logits to LOGIT_TOLERANCE, exact round trip) or is refused by name."""
from rlcore_testing.models import OMIT, published_config, sweep_tests
from rlcore_model_llama.plugin import LLAMA

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)
LLAMA_31 = published_config("llama-3.1-8b", **TINY)
LLAMA_32 = published_config("llama-3.2-1b", **TINY, head_dim=32)


def llama3(**changed):
    return {"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3", **changed}}


CASES_31 = [   # (case, the key a refusal must name, or None: it must conform)
    ({"rms_norm_eps": 1e-6}, None),
    ({"rms_norm_eps": 1e-2}, None),
    ({"rope_theta": 1e4}, None),
    ({"rope_theta": OMIT}, None),                     # transformers' default (1e4)
    ({"rope_scaling": OMIT}, None),                   # Llama 3.0: plain RoPE
    (llama3(factor=32.0), None),                      # Llama 3.2's
    (llama3(factor=2.0), None),
    (llama3(low_freq_factor=2.0), "low_freq_factor"),             # megatron-core fixes 1, 4 and 8192
    (llama3(high_freq_factor=8.0), "high_freq_factor"),
    (llama3(original_max_position_embeddings=4096), "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"head_dim": 16}, None),                         # not hidden_size / heads: Llama takes it as given
    ({"num_key_value_heads": 2}, None),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, None),
    ({"hidden_size": 96}, None),
    ({"num_hidden_layers": 3}, None),
    ({"max_position_embeddings": 128}, None),
    ({"vocab_size": 80}, None),
    ({"intermediate_size": 80}, None),
    ({"tie_word_embeddings": True}, None),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rms_norm_eps": 1e-6, "rope_theta": OMIT, "head_dim": 16, "num_key_value_heads": 2, "num_hidden_layers": 3,
      "tie_word_embeddings": True, **llama3(factor=32.0)}, None),
]
CASES_32 = [
    ({"head_dim": OMIT}, None),                       # hidden_size / heads
    ({"tie_word_embeddings": False}, None),
    ({"tie_word_embeddings": OMIT}, None),            # transformers' default (false)
    (llama3(), None),                                 # Llama 3.1's factor
    ({"rope_scaling": OMIT, "num_key_value_heads": 2, "vocab_size": 80}, None),
]
NOT_VARIED = {"architectures", "model_type",
              "rope_parameters"}   # rope_theta's and rope_scaling's normal form, varied through them

test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads = sweep_tests(
    {"llama-3.1-8b": (LLAMA, LLAMA_31, CASES_31), "llama-3.2-1b": (LLAMA, LLAMA_32, CASES_32)}, NOT_VARIED)
