"""Each user mistake: non-zero exit and one clear line on stderr, before any model or engine starts."""
import subprocess
import sys

import pytest


def rlcore(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "rlcore.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, expected", [
    (["run", "--plugins=qwen3,grpo,nosuch"], "unknown plugin(s) 'nosuch' in --plugins. Installed plugins:"),
    (["run", "trainer.stpes=5"], "unknown config key 'trainer.stpes' (did you mean 'steps'?)"),
    (["run", "trainer.steps=five"], "config key 'trainer.steps' has an invalid value 'five': Value 'five' of type "
                                    "'str' could not be converted to Integer"),
    (["run", "model.path=/nonexistent/ckpt"], "model.path '/nonexistent/ckpt' does not exist"),
    (["run", "--plugins=qwen3,grpo,vllm", "model.family=llama"],
     "no model named 'llama' is registered (registered: qwen3, qwen3_moe)"),
    (["run", "--plugins=qwen3,grpo,vllm", "algorithm.name=ppo"], "no algorithm named 'ppo' is registered"),
    (["run", "algorithm.clip_ratio=0.3"], "unknown config key 'algorithm.clip_ratio'"),
    (["run", "missing.yaml"], "config file 'missing.yaml' does not exist"),
])
def test_mistake_exits_non_zero_with_one_message(args, expected):
    result = rlcore(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def refusal_of_checkpoint(path, hf_overrides: dict) -> list[str]:
    """The error lines of `rlcore run` on a tiny Qwen3 checkpoint whose config.json has ``hf_overrides``: it must
    exit 2 before any worker starts, without a traceback."""
    from rlcore.testing import tiny_checkpoint
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    tiny_checkpoint(QWEN3, str(path), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_hidden_size=64, max_position_embeddings=32, hf_overrides=hf_overrides)
    write_char_tokenizer(str(path))
    result = rlcore("run", "--plugins=qwen3,grpo,vllm", f"model.path={path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]


def test_model_config_the_plugin_cannot_map_is_refused_before_workers_start(tmp_path):
    """A real checkpoint (transformers' Qwen3 with attention biases) that the Qwen3 plugin cannot reproduce."""
    assert refusal_of_checkpoint(tmp_path, {"attention_bias": True}) == [
        f"rlcore: error: model.path {tmp_path}: Qwen3 with attention_bias=True in config.json is not supported: "
        "transformers adds a bias to q/k/v and o_proj; megatron-core has a q/k/v-only bias (add_qkv_bias) or biases on "
        "every linear layer, neither of which matches"]


def test_quantization_rlcore_cannot_load_is_refused_before_workers_start(tmp_path):
    """An AWQ checkpoint's packed integers would otherwise load as weights of another model."""
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    (line,) = refusal_of_checkpoint(tmp_path, {"quantization_config": awq})
    assert f"model.path {tmp_path}: its config.json declares quantization_config with quant_method 'awq'" in line
    assert "unquantized" in line


def test_plugins_command_lists_distributions_and_registrations():
    result = rlcore("plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("qwen3      rlcore-model-qwen3 0.1.0", "grpo       rlcore-algo-grpo 0.1.0",
                     "vllm       rlcore-rollout-vllm 0.1.0", "models            qwen3",
                     "rollout_backends  vllm", "tasks             addition"):
        assert expected in out, out
