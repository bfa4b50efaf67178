"""A reward function loaded from a file (task.reward_fn): rlcore's batched signature and verl's compute_score."""
import sys

import pytest

from rlcore.errors import ConfigError
from rlcore.rewards import load_reward_file

from runs import run_cli

BATCHED = '''
def longer_is_better(responses, metadata):
    return [min(len(r), 10) / 10 for r in responses]
'''
VERL = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": float(correct), "acc": correct} if data_source == "dict" else float(correct)

def _helper():
    pass
'''


def test_batched_and_verl_signatures(tmp_path):
    (tmp_path / "mine.py").write_text(BATCHED)
    (tmp_path / "verl_style.py").write_text(VERL)
    batched = load_reward_file(f"{tmp_path}/mine.py:longer_is_better")
    assert batched.name == "longer_is_better" and batched.fn(["abcde", ""], [{}, {}]) == [0.5, 0.0]
    verl = load_reward_file(f"{tmp_path}/verl_style.py:compute_score")
    metadata = [{"answer": "72", "data_source": "openai/gsm8k"}, {"answer": "5", "data_source": "dict"},
                {"answer": "5", "data_source": "dict"}]
    assert verl.fn([" 72 ", "5", "6"], metadata) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("content, target, message", [
    (None, "{dir}/reward.py", "give path/to/file.py:function"),
    (None, "{dir}/missing.py:score", "the file '{dir}/missing.py' does not exist"),
    ("import no_such_module\n", "{dir}/reward.py:score",
     "importing '{dir}/reward.py' failed: ModuleNotFoundError: No module named 'no_such_module'"),
    (VERL, "{dir}/reward.py:score", "'{dir}/reward.py' defines no function 'score' (it defines: _helper, "
                                    "compute_score)"),
])
def test_mistakes_name_the_file_and_what_to_do(tmp_path, content, target, message):
    if content is not None:
        (tmp_path / "reward.py").write_text(content)
    with pytest.raises(ConfigError) as e:
        load_reward_file(target.format(dir=tmp_path))
    assert message.format(dir=tmp_path) in str(e.value)


def test_a_run_scores_with_the_file_reward(tmp_path):
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.run import Run

    (tmp_path / "mine.py").write_text(BATCHED)
    cfg = load_config("quickstart", [f"task.reward_fn={tmp_path}/mine.py:longer_is_better"])
    run = Run(cfg, load_plugins(["qwen3", "grpo", "vllm"]))
    scores = run.rewards(["abcde", "abcdefghijkl"], [{"answer": "1"}, {"answer": "2"}])
    assert scores.total.tolist() == [0.5, 1.0]


def test_cli_refuses_a_missing_reward_file_in_one_line(tmp_path):
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", f"task.reward_fn={tmp_path}/none.py:score"],
                     timeout=120)
    assert result.returncode == 2
    assert result.stderr.rstrip().splitlines()[-1] == \
        f"rlcore: error: task.reward_fn: the file '{tmp_path}/none.py' does not exist", result.stderr[-2000:]
