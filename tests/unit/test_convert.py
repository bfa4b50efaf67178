"""Name lookup of weight rules: TransformerEngine's fused-norm parameter names resolve to the rules written for
megatron-core's local layer names; an unknown name says which parameter no rule covers."""
import pytest

from rlcore.convert import Layout, Rename, WeightConverter

from runs import run_cli


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


# --- a converted checkpoint's dtype against actor.dtype, checked before anything starts ------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Qwen3 HF checkpoint (its tokenizer one token per character) through `rlcore convert` at its default
    dtype, bfloat16."""
    import sys

    from rlcore_testing.models import tiny_checkpoint
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    hf, out = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("converted") / "ckpt"
    tiny_checkpoint(QWEN3, str(hf), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_hidden_size=64, max_position_embeddings=32)
    write_char_tokenizer(str(hf))
    result = run_cli([sys.executable, "-m", "rlcore.cli", "convert", str(hf), str(out), "--plugins=qwen3"],
                     timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_a_converted_checkpoint_at_another_dtype_than_the_actors_is_refused_before_anything_starts(converted,
                                                                                                     tmp_path):
    import json
    import sys

    assert json.loads((converted / "rlcore_converted.json").read_text())["dtype"] == "bfloat16"
    expected = [f"rlcore: error: model.path {converted} was converted at bfloat16 (rlcore convert --dtype); "
                "actor.dtype is float32: set actor.dtype=bfloat16 or convert again with --dtype float32"]
    args = ["--plugins=qwen3,grpo,vllm", f"model.path={converted}", "actor.dtype=float32"]
    for extra in ([f"run.dir={tmp_path / 'run'}"], ["--dry-run"]):
        result = run_cli([sys.executable, "-m", "rlcore.cli", "run", *args, *extra], timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")] == expected
    agreeing = run_cli([sys.executable, "-m", "rlcore.cli", "run", *args[:-1], "actor.dtype=bfloat16",
                        "--dry-run"], timeout=120)
    assert agreeing.returncode == 0, agreeing.stderr[-2000:]
