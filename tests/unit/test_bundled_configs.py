"""The model configs bundled in configs/models are the published config.json files: every key as published,
laid out as published. The conformance sweeps start from them and --dry-run sizes the presets with them, so a key
dropped here is a part of what users download that nothing tests (DeepSeek-V3's FP8 quantization_config was)."""
import json
from importlib import resources

import pytest

from rlcore.quantization import BlockFP8, checkpoint_quantization

MODELS = resources.files("rlcore.presets") / "models"

# every key each bundled config has (all of the published file's); a file may gain keys, never lose one
KEYS = {
    "deepseek-v3": """
        architectures attention_bias attention_dropout auto_map aux_loss_alpha bos_token_id eos_token_id ep_size
        first_k_dense_replace hidden_act hidden_size initializer_range intermediate_size kv_lora_rank
        max_position_embeddings model_type moe_intermediate_size moe_layer_freq n_group n_routed_experts
        n_shared_experts norm_topk_prob num_attention_heads num_experts_per_tok num_hidden_layers
        num_key_value_heads num_nextn_predict_layers pretraining_tp q_lora_rank qk_nope_head_dim qk_rope_head_dim
        quantization_config rms_norm_eps rope_scaling rope_theta routed_scaling_factor scoring_func seq_aux
        tie_word_embeddings topk_group topk_method torch_dtype transformers_version use_cache v_head_dim vocab_size""",
    "llama-3.1-8b": """
        architectures attention_bias attention_dropout bos_token_id eos_token_id hidden_act hidden_size
        initializer_range intermediate_size max_position_embeddings mlp_bias model_type num_attention_heads
        num_hidden_layers num_key_value_heads pretraining_tp rms_norm_eps rope_scaling rope_theta
        tie_word_embeddings torch_dtype transformers_version use_cache vocab_size""",
    "llama-3.2-1b": """
        architectures attention_bias attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size
        initializer_range intermediate_size max_position_embeddings mlp_bias model_type num_attention_heads
        num_hidden_layers num_key_value_heads pretraining_tp rms_norm_eps rope_scaling rope_theta
        tie_word_embeddings torch_dtype transformers_version use_cache vocab_size""",
    "mixtral-8x7b": """
        architectures attention_dropout bos_token_id eos_token_id hidden_act hidden_size initializer_range
        intermediate_size max_position_embeddings model_type num_attention_heads num_experts_per_tok
        num_hidden_layers num_key_value_heads num_local_experts output_router_logits rms_norm_eps rope_theta
        router_aux_loss_coef sliding_window tie_word_embeddings torch_dtype transformers_version use_cache
        vocab_size""",
    "moonlight-16b-a3b": """
        architectures attention_bias first_k_dense_replace hidden_act hidden_size intermediate_size kv_lora_rank
        max_position_embeddings model_type moe_intermediate_size moe_layer_freq n_group n_routed_experts
        n_shared_experts norm_topk_prob num_attention_heads num_experts_per_tok num_hidden_layers
        num_key_value_heads num_nextn_predict_layers q_lora_rank qk_nope_head_dim qk_rope_head_dim rms_norm_eps
        rope_scaling rope_theta routed_scaling_factor scoring_func tie_word_embeddings topk_group topk_method
        v_head_dim vocab_size""",
    "qwen2-57b-a14b": """
        architectures attention_dropout bos_token_id decoder_sparse_step eos_token_id hidden_act hidden_size
        initializer_range intermediate_size max_position_embeddings max_window_layers model_type
        moe_intermediate_size norm_topk_prob num_attention_heads num_experts num_experts_per_tok num_hidden_layers
        num_key_value_heads output_router_logits rms_norm_eps rope_theta router_aux_loss_coef
        shared_expert_intermediate_size sliding_window tie_word_embeddings torch_dtype transformers_version
        use_cache use_sliding_window vocab_size""",
    "qwen2-7b-instruct": """
        architectures attention_dropout bos_token_id eos_token_id hidden_act hidden_size initializer_range
        intermediate_size max_position_embeddings max_window_layers model_type num_attention_heads num_hidden_layers
        num_key_value_heads rms_norm_eps rope_theta sliding_window tie_word_embeddings torch_dtype
        transformers_version use_cache use_sliding_window vocab_size""",
    "qwen2.5-0.5b": """
        architectures attention_dropout bos_token_id eos_token_id hidden_act hidden_size initializer_range
        intermediate_size max_position_embeddings max_window_layers model_type num_attention_heads num_hidden_layers
        num_key_value_heads rms_norm_eps rope_theta sliding_window tie_word_embeddings torch_dtype
        transformers_version use_cache use_mrope use_sliding_window vocab_size""",
    "qwen2.5-7b-instruct": """
        architectures attention_dropout bos_token_id eos_token_id hidden_act hidden_size initializer_range
        intermediate_size max_position_embeddings max_window_layers model_type num_attention_heads num_hidden_layers
        num_key_value_heads rms_norm_eps rope_theta sliding_window tie_word_embeddings torch_dtype
        transformers_version use_cache use_sliding_window vocab_size""",
    "qwen3-235b-a22b": """
        architectures attention_bias attention_dropout bos_token_id decoder_sparse_step eos_token_id head_dim
        hidden_act hidden_size initializer_range intermediate_size max_position_embeddings max_window_layers
        mlp_only_layers model_type moe_intermediate_size norm_topk_prob num_attention_heads num_experts
        num_experts_per_tok num_hidden_layers num_key_value_heads output_router_logits rms_norm_eps rope_scaling
        rope_theta router_aux_loss_coef sliding_window tie_word_embeddings torch_dtype transformers_version
        use_cache use_sliding_window vocab_size""",
    "qwen3-30b-a3b": """
        architectures attention_bias attention_dropout bos_token_id decoder_sparse_step eos_token_id head_dim
        hidden_act hidden_size initializer_range intermediate_size max_position_embeddings max_window_layers
        mlp_only_layers model_type moe_intermediate_size norm_topk_prob num_attention_heads num_experts
        num_experts_per_tok num_hidden_layers num_key_value_heads output_router_logits rms_norm_eps rope_scaling
        rope_theta router_aux_loss_coef sliding_window tie_word_embeddings torch_dtype transformers_version
        use_cache use_sliding_window vocab_size""",
    "qwen3-8b": """
        architectures attention_bias attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size
        initializer_range intermediate_size max_position_embeddings max_window_layers model_type num_attention_heads
        num_hidden_layers num_key_value_heads rms_norm_eps rope_scaling rope_theta sliding_window
        tie_word_embeddings torch_dtype transformers_version use_cache use_sliding_window vocab_size""",
}
# bundled before the rest were restored as published and not yet checked against the published file: one space of
# indentation, and its keys agree with moonshotai/Moonlight-16B-A3B-Instruct's but for rope_scaling (null here, absent
# there) and the keys that file has besides
NOT_YET_AS_PUBLISHED = {"moonlight-16b-a3b"}


def bundled(name: str) -> tuple[str, dict]:
    text = (MODELS / f"{name}.json").read_text()
    return text, json.loads(text)


@pytest.mark.parametrize("name", sorted(KEYS))
def test_a_bundled_config_keeps_every_key(name):
    _, config = bundled(name)
    missing = sorted(set(KEYS[name].split()) - set(config))
    assert not missing, f"configs/models/{name}.json lost {missing}: restore them as published"


@pytest.mark.parametrize("name", sorted(set(KEYS) - NOT_YET_AS_PUBLISHED))
def test_a_bundled_config_is_laid_out_as_published(name):
    """Hugging Face's files are JSON indented by two, in their own key order (transformers sorts the keys; a file
    edited by hand, as Llama-3.1-8B's rope_scaling, keeps its order), ending in a newline."""
    text, config = bundled(name)
    assert text == json.dumps(config, indent=2) + "\n"


def test_deepseek_v3_is_bundled_in_block_fp8_as_published():
    """As published (deepseek-ai/DeepSeek-V3), and what a run and --dry-run load: block FP8, dequantized on load."""
    _, config = bundled("deepseek-v3")
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    assert checkpoint_quantization(config) == BlockFP8((128, 128))
