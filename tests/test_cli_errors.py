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
    (["run", "trainer.steps=five"], "config key 'trainer.steps' has an invalid value 'five'"),
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


def test_plugins_command_lists_distributions_and_registrations():
    result = rlcore("plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("qwen3      rlcore-model-qwen3 0.1.0", "grpo       rlcore-algo-grpo 0.1.0",
                     "vllm       rlcore-rollout-vllm 0.1.0", "models            qwen3",
                     "rollout_backends  vllm", "tasks             addition"):
        assert expected in out, out
