"""Rewards by data_source: a mixed dataset scores each row with the reward of its source (verl's dataset names map to
the built-in rewards), a source without one is refused before anything starts, naming the sources and rewards."""
import math
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.rewards import RewardComposer, SourceDispatch, build_rewards

from runs import run_cli

GSM8K_ROW = ("She sold 72 in all.\n#### 72", {"answer": "72", "data_source": "openai/gsm8k"})
MATH_ROW = ("so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5", "data_source": "lighteval/MATH"})


def registry():
    return load_plugins(["grpo"]).registry          # rlcore's own rewards come with every selection


def task_section(*overrides):
    return load_config(None, list(overrides)).task


def score(reward, rows):
    return reward([r for r, _ in rows], [m for _, m in rows])


def test_verl_sources_are_scored_by_their_registered_rewards():
    reward = build_rewards(task_section(), "", {"openai/gsm8k": 3, "lighteval/MATH": 2}, registry())
    assert isinstance(reward, SourceDispatch)
    # the gsm8k reward would fail the boxed answer, math-verify passes it; and the reverse for '#### 72' vs 'x'
    scores = score(reward, [GSM8K_ROW, MATH_ROW, ("#### 71", GSM8K_ROW[1]), ("\\boxed{2}", MATH_ROW[1])])
    assert scores.total.tolist() == [1.0, 1.0, 0.0, 0.0]
    gsm8k, mathv = scores.components["gsm8k"].tolist(), scores.components["math"].tolist()
    assert gsm8k[0] == 1.0 and gsm8k[2] == 0.0 and math.isnan(gsm8k[1]) and math.isnan(gsm8k[3])
    assert mathv[1] == 1.0 and mathv[3] == 0.0 and math.isnan(mathv[0])
    assert scores.metrics()["reward/gsm8k/mean"] == 0.5             # over its own source's rows only


def test_source_rewards_map_a_source_and_the_general_reward_scores_the_rest():
    reward = build_rewards(task_section("task.reward=exact_match", "task.source_rewards={mine: gsm8k}"), "",
                           {"mine": 1, "other": 1}, registry())
    scores = score(reward, [("#### 5", {"answer": "5", "data_source": "mine"}),
                            ("#### 5", {"answer": "5", "data_source": "other"}),
                            ("5", {"answer": "5", "data_source": "other"})])
    assert scores.total.tolist() == [1.0, 0.0, 1.0]


def test_a_reward_for_every_row_needs_no_dispatch():
    reward = build_rewards(task_section("task.reward=gsm8k"), "", {"anything": 4}, registry())
    assert isinstance(reward, RewardComposer)
    assert isinstance(build_rewards(task_section(), "exact_match", {}, registry()), RewardComposer)


def test_a_source_without_a_reward_names_the_sources_and_the_rewards():
    with pytest.raises(ConfigError) as e:
        build_rewards(task_section(), "", {"openai/gsm8k": 7473, "my_set": 12}, registry())
    assert str(e.value) == (
        "no reward for data_source 'my_set'. Sources found: my_set (12 rows), openai/gsm8k (7473 rows). Rewards "
        "registered (with the sources they score): environment, exact_match (rlcore/addition), final_answer, geo3k "
        "(hiyouga/geometry3k), gsm8k (openai/gsm8k), math (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, "
        "HuggingFaceH4/MATH-500). Map it with task.source_rewards={my_set: <reward>}, or score every row with "
        "task.reward=<reward>")
    with pytest.raises(ConfigError, match="no reward for rows without a data_source"):
        build_rewards(task_section(), "", {"": 3}, registry())
    with pytest.raises(Exception, match="no reward named 'nosuch'"):
        build_rewards(task_section("task.source_rewards={my_set: nosuch}"), "", {"my_set": 1}, registry())


def test_cli_refuses_an_unmapped_source_before_workers_start(tmp_path):
    rows = [{"data_source": "my_set", "prompt": [{"role": "user", "content": "1+1="}],
             "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "task.name=dataset",
                      f"task.options.train_files=[{tmp_path / 'train.parquet'}]"],
                     timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert len(lines) == 1 and "no reward for data_source 'my_set'. Sources found: my_set (1 rows)" in lines[0]
    assert "Traceback" not in result.stderr


def test_source_rewards_from_the_command_line_keep_slashes_in_names():
    cfg = load_config(None, ["task.source_rewards={openai/gsm8k: math}"])
    assert dict(cfg.task.source_rewards) == {"openai/gsm8k": "math"}
