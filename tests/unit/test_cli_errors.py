"""Each user mistake: non-zero exit and one clear line on stderr, before any model or engine starts."""
import sys

import pytest

from runs import run_cli


def rlcore(*args, timeout=120):
    return run_cli([sys.executable, "-m", "rlcore.cli", *args], timeout=timeout)


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
    (["run", "--plugins=qwen3,grpo,vllm", "model.family=qwen3_moe", "actor.moe.routing_replay=rollout"],
     "actor.moe.routing_replay = 'rollout' with rollout.backend = 'vllm': that engine cannot return the experts"),
    (["run", "actor.moe.routing_replay=on"], "actor.moe.routing_replay"),
    (["run", "actor.freeze=[tower]"], "config key 'actor.freeze' = ['tower'] is not allowed: use a list of parts, "
                                      "each once, from vision_tower, projector, language_model"),
    (["run", "actor.freeze=[language_model]", "actor.lora.rank=8"], "LoRA already keeps every base weight as loaded"),
    (["run", "--plugins=qwen3,grpo,vllm", "actor.freeze=[vision_tower]"],
     "actor.freeze = ['vision_tower'] names vision_tower, which model.family = 'qwen3' lacks (it has no vision tower)"),
    (["run", "--plugins=qwen3,grpo,vllm", "actor.freeze=[language_model]"],
     "actor.freeze = ['language_model'] freezes every part of model.family = 'qwen3': nothing would train"),
    (["run", "--plugins=qwen2_vl,grpo,vllm", "visual-quickstart", "actor.freeze=[language_model]",
      "trainer.world_size=2", "actor.parallel.pp=2"],
     "actor.freeze = ['language_model'] with actor.parallel.pp = 2: the pipeline stages after the first hold only"),
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
    from rlcore_testing.models import tiny_checkpoint
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


# --- refused before any worker starts, by the checks the dry run makes -----------------------------------------------

def error_lines(result) -> list[str]:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory):
    """A tiny Qwen3 checkpoint with 4 attention heads over 2 query groups (an FFN width of 96, which 3 divides) and a
    32-token context, its tokenizer one token per character."""
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    path = tmp_path_factory.mktemp("four_heads")
    tiny_checkpoint(QWEN3, str(path), hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                    ffn_hidden_size=96, max_position_embeddings=32)
    write_char_tokenizer(str(path))
    return path


def test_a_layout_the_model_cannot_split_is_refused_as_the_dry_run_refuses_it(four_heads, tmp_path):
    """tp=3 with 4 heads died in a Ray worker with Megatron's traceback; the run now asks the dry run's question."""
    args = ["--plugins=qwen3,grpo,vllm", f"model.path={four_heads}", "actor.parallel.tp=3", "trainer.world_size=3",
            f"run.dir={tmp_path / 'run'}"]
    problems = ["attention heads = 4 is not divisible by actor.parallel.tp = 3",
                "query groups (KV heads) = 2 is not divisible by actor.parallel.tp = 3",
                "actor.parallel.tp values that divide every size it splits: 1, 2"]
    assert error_lines(rlcore("run", *args)) == [
        f"rlcore: error: the layout does not fit the model: {'; '.join(problems)} (rlcore run --dry-run checks a "
        "layout without starting anything)"]
    dry = rlcore("run", "--dry-run", *args)
    assert error_lines(dry) == ["rlcore: error: the layout does not fit the model:"]
    assert dry.stderr.splitlines()[-len(problems):] == [f"  - {p}" for p in problems]


def test_a_response_budget_the_context_cannot_hold_is_refused_before_workers_start(four_heads, tmp_path):
    expected = ["rlcore: error: rollout.max_response_len = 32 leaves no room for a prompt in the model's context of "
                "32 tokens (max_position_embeddings): set rollout.max_response_len below 32, minus the longest prompt"]
    args = ["--plugins=qwen3,grpo,vllm", f"model.path={four_heads}", "rollout.max_response_len=32"]
    assert error_lines(rlcore("run", *args, f"run.dir={tmp_path / 'run'}")) == expected
    assert error_lines(rlcore("run", "--dry-run", *args)) == expected


def test_the_tiny_models_checks_come_before_its_warm_start(tmp_path):
    """The quickstart builds its model and warm-starts it (a minute or more on a cache miss): a run that would be
    refused is refused first, leaving nothing in the cache."""
    cache = tmp_path / "cache"
    result = rlcore("run", "--plugins=qwen3,grpo,vllm", "actor.parallel.pp=3", "trainer.world_size=3",
                    f"warm_start.cache_dir={cache}", f"run.dir={tmp_path / 'run'}")
    assert error_lines(result) == [
        "rlcore: error: the layout does not fit the model: 4 layers do not split evenly over actor.parallel.pp = 3 "
        "stages: choose pp dividing 4, or set actor.parallel.last_stage_layers (rlcore run --dry-run checks a layout "
        "without starting anything)"]
    assert list(cache.iterdir()) == []


def test_one_train_file_as_verl_gives_it_and_its_longest_prompt_is_checked_against_the_context(four_heads, tmp_path):
    """task.options.train_files=<path> (verl's form for one file) is a list of one; the file's longest prompt (22
    characters, under max_prompt_len) with a 16-token response overflows the 32-token context: refused before the
    engines start, where it used to fail at the first step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "addition", "prompt": p, "reward_model": {"ground_truth": a}}
            for p, a in [("12+34=", "46"), ("1234567890+1234567890=", "2469135780")]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    result = rlcore("run", "--plugins=qwen3,grpo,vllm", f"model.path={four_heads}", "task.name=dataset",
                    f"task.options.train_files={tmp_path / 'train.parquet'}", "task.options.chat_template=false",
                    "task.reward=exact_match", "rollout.max_response_len=16", f"run.dir={tmp_path / 'run'}")
    assert "rlcore: 2 training prompts (0 left out as too long)" in result.stderr, result.stderr[-2000:]
    assert error_lines(result) == [
        "rlcore: error: the longest prompt has 22 tokens: with rollout.max_response_len = 16 that is 38, more than "
        "the model's context of 32 tokens (max_position_embeddings): set rollout.max_response_len=10, or "
        "task.options.max_prompt_len=16 to leave the longer prompts out"]
