"""Name lookup of weight rules: TransformerEngine's fused-norm parameter names resolve to the rules written for
megatron-core's local layer names; an unknown name says which parameter no rule covers."""
import pytest

from rlcore.convert import Layout, Rename, WeightConverter


def converter():
    rules = [Rename("decoder.layers.{layer}.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight"),
             Rename("decoder.layers.{layer}.pre_mlp_layernorm.weight",
                    "model.layers.{layer}.post_attention_layernorm.weight"),
             Rename("decoder.layers.{layer}.self_attention.kv_layernorm.weight",
                    "model.layers.{layer}.self_attn.kv_a_layernorm.weight")]
    return WeightConverter(rules, num_layers=3, layout=Layout(4, 2, 8, 16))


@pytest.mark.parametrize("te_name, hf_name", [
    ("decoder.layers.2.self_attention.linear_qkv.layer_norm_weight", "model.layers.2.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "model.layers.0.post_attention_layernorm.weight"),
    ("decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
     "model.layers.1.self_attn.kv_a_layernorm.weight"),
])
def test_transformer_engine_fused_norm_names(te_name, hf_name):
    assert converter().rule(te_name).hf_names() == [hf_name]


def test_unknown_parameter_is_named():
    with pytest.raises(KeyError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        converter().rule("decoder.layers.1.mlp.linear_fc2.weight")
