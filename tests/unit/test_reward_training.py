"""The pure parts of reward models: the Bradley-Terry loss, preference files (columns, chat messages, the end of
sequence), pairs kept whole in data-parallel shares and micro-batches, each step's pairs fixed by the seed, how a
reward model joins the run's rewards, and the task's synthetic pairs."""
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlcore.config import load_config
from rlcore.datasets.preferences import pair_batch, read_pairs, render, tokenize_pairs
from rlcore.errors import ConfigError
from rlcore.losses import bradley_terry
from rlcore.plugins import load_plugins
from rlcore.rewards import build_rewards, functions_only
from rlcore.specs import RewardSpec


def test_bradley_terry_is_the_mean_negative_log_sigmoid_of_the_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0, 5.0]), torch.tensor([1.0, 1.0, 1.0, -5.0])
    real = torch.tensor([True, True, True, False])           # the last pair is pipeline filler
    loss, metrics = bradley_terry(chosen, rejected, real, total_pairs=6)
    expected = [-math.log(1 / (1 + math.exp(-m))) for m in (1.0, -1.0, 0.0)]
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert metrics["rm/loss"] == pytest.approx(sum(expected) / 3)
    assert metrics["rm/accuracy"] == pytest.approx(1 / 3) and metrics["rm/margin"] == pytest.approx(0.0)


def test_preference_files_with_a_missing_column_are_refused_naming_it(tmp_path):
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "chosen": ["2"], "reject": ["3"]}), path)
    with pytest.raises(ConfigError, match=r"no column 'rejected' for the rejected \(reward_training.rejected_key\); "
                                          r"its columns are \['chosen', 'prompt', 'reject'\]"):
        read_pairs([str(path)], "prompt", "chosen", "rejected")
    assert read_pairs([str(path)], "prompt", "chosen", "reject") == [("1+1=", "2", "3")]


def test_pairs_render_as_text_or_chat_and_end_in_the_end_of_sequence(chat_tokenizer):
    eos = chat_tokenizer.eos_token_id
    text = render("1+1=", "2", chat_tokenizer)
    assert text == chat_tokenizer.encode("1+1=2", add_special_tokens=False) + [eos]
    messages = [{"role": "user", "content": "1+1="}]
    chat = render(messages, [{"role": "assistant", "content": "2"}], chat_tokenizer)
    expected = chat_tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "2"}], tokenize=True)
    expected = list(expected["input_ids"] if isinstance(expected, dict) else expected)
    assert chat[:len(expected)] == expected and chat[-1] == eos
    assert render(messages, "2", chat_tokenizer) == chat     # a text response is the assistant's turn


def test_pair_rows_stay_together_and_long_pairs_are_counted(chat_tokenizer):
    pairs = tokenize_pairs([("1+1=", "2", "3"), ("2+2=", "4", "5" * 40), ("3+3=", "6", "7")], chat_tokenizer,
                           context=20)
    assert len(pairs) == 2 and pairs.too_long == 1
    batch = pair_batch(pairs, [1, 0], pad_id=0)
    assert "prompt_len" not in batch.tensors          # data-parallel shares stay contiguous
    assert batch["input_ids"].shape[0] == 4
    assert batch["input_ids"][0, :len(pairs.chosen[1])].tolist() == pairs.chosen[1]
    assert batch["input_ids"][3, :len(pairs.rejected[0])].tolist() == pairs.rejected[0]


def test_each_steps_pairs_are_fixed_by_the_seed_and_cover_each_epoch():
    from rlcore.reward_training import RewardModelTraining

    cfg = load_config("quickstart", ["reward_training.synthetic_pairs=100", "reward_training.val_pairs=10",
                                     "reward_training.pairs_per_step=16", "reward_training.epochs=2"])
    training = RewardModelTraining(cfg, load_plugins(["qwen3", "grpo", "vllm"]))
    assert cfg.trainer.steps == math.ceil(2 * 100 / 16)
    training.train_tokens = type("Pairs", (), {"__len__": lambda self: 100})()
    first_epoch = [i for step in range(1, 7) for i in training.step_pairs(step)] + training.step_pairs(7)[:4]
    assert sorted(first_epoch) == list(range(100))
    assert training.step_pairs(3) == training.step_pairs(3)
    assert training.step_pairs(8) != training.step_pairs(1)


def test_synthetic_pairs_prefer_the_right_sum_and_hold_out_the_held_out_prompts():
    cfg = load_config("quickstart", [])
    task = load_plugins(["grpo"]).registry.get("tasks", "addition").build(dict(cfg.task.options), 0)
    pairs = task.preference_pairs(500, held_out=False)
    held = task.preference_pairs(100, held_out=True)
    for prompt, chosen, rejected in pairs + held:
        a, b = prompt[:-1].split("+")
        assert chosen == str(int(a) + int(b)) and rejected != chosen
    held_prompts = {p for p, _ in task.eval_prompts()}
    assert all(p in held_prompts for p, _, _ in held) and not any(p in held_prompts for p, _, _ in pairs)


def reward_model_spec():
    return RewardSpec("rm", lambda responses, metadata, sequences: [float(len(s)) for s in sequences],
                      sequences=True)


def test_an_unnamed_reward_model_is_the_reward_and_the_tasks_reward_is_logged_beside_it():
    registry = load_plugins(["grpo"]).registry
    registry.add("rewards", reward_model_spec(), owner="test")
    rewards = build_rewards(load_config("quickstart", []).task, "exact_match", {}, registry, model_reward="rm")
    scores = rewards(["5", "x"], [{"answer": "5"}, {"answer": "5"}], [[1, 2, 3], [1]])
    assert scores.total.tolist() == [3.0, 1.0]
    assert scores.components["exact_match"].tolist() == [1.0, 0.0]
    warm = functions_only(rewards)          # what scores before the reward model's workers start
    assert warm(["5", "x"], [{"answer": "5"}] * 2).total.tolist() == [1.0, 0.0]


def test_a_named_reward_model_is_a_weighted_component_and_a_reward_that_omits_it_is_refused():
    registry = load_plugins(["grpo"]).registry
    registry.add("rewards", reward_model_spec(), owner="test")
    task = load_config("quickstart", ["task.rewards={rm: 0.5, exact_match: 1.0}"]).task
    rewards = build_rewards(task, "exact_match", {}, registry, model_reward="rm")
    assert rewards(["5"], [{"answer": "5"}], [[1, 2]]).total.tolist() == [2.0]
    with pytest.raises(ConfigError, match="does not name its reward 'rm'"):
        build_rewards(load_config("quickstart", ["task.reward=exact_match"]).task, "exact_match", {}, registry,
                      model_reward="rm")


def test_a_logged_reward_that_fails_fails_no_sample():
    registry = load_plugins(["grpo"]).registry
    registry.add("rewards", reward_model_spec(), owner="test")
    registry.add("rewards", RewardSpec("broken", lambda r, m: 1 / 0), owner="test")
    task = load_config("quickstart", ["task.rewards={rm: 1.0, broken: 0.0}"]).task
    scores = build_rewards(task, "exact_match", {}, registry, model_reward="rm")(["5"], [{}], [[1]])
    assert scores.total.tolist() == [1.0] and not scores.failed.any()
    assert math.isnan(scores.components["broken"][0]) and json.dumps(dict(scores.reasons))
