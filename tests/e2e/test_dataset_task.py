"""The `dataset` task: verl-format files through the task contract, and end to end the addition task exported as a
verl Parquet file trains through it (real megatron-core, real vLLM) and learns as the built-in task does."""
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from runs import ENV, run_cli, run_to_end
from rlcore_testing.models import reward_gain

from rlcore_plugins.tasks.dataset import _build


def verl_rows(prompts_and_answers, source="addition", messages=False):
    return [{"data_source": source,
             "prompt": [{"role": "user", "content": p}] if messages else p,
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"index": i}} for i, (p, a) in enumerate(prompts_and_answers)]


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_prompts_are_rendered_sampled_per_epoch_and_carry_the_ground_truth(tmp_path, chat_tokenizer, capsys):
    train = write(tmp_path / "train.parquet", verl_rows([(f"What is {i}+3?", str(i + 3)) for i in range(5)] +
                                                        [("Natalia sold 48 clips in April. " * 20, "x")],
                                                        messages=True))
    val = write(tmp_path / "val.parquet", verl_rows([("What is 2+3?", "5")], messages=True))
    task = _build({"train_files": [train], "val_files": [val], "max_prompt_len": 40}, seed=0)
    task.bind_tokenizer(chat_tokenizer)
    assert task.left_out == 1 and "5 training prompts (1 left out as too long)" in capsys.readouterr().err
    first = task.train_prompts(step=1, count=3)
    assert task.train_prompts(step=1, count=5)[:3] == first                 # a larger count extends the step
    epoch = {m["answer"] for _, m in task.train_prompts(1, 5)}
    assert epoch == {"3", "4", "5", "6", "7"}                               # one epoch: every prompt once
    text, meta = task.eval_prompts()[0]
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert meta == {"answer": "5", "data_source": "addition", "extra_info": {"index": 0},
                    "messages": [{"role": "user", "content": "What is 2+3?"}]}


def test_sources_are_counted_and_the_sampler_position_resumes_the_prompt_sequence(tmp_path, chat_tokenizer):
    rows = verl_rows([(f"What is {i}+1?", str(i + 1)) for i in range(7)], source="openai/gsm8k", messages=True)
    train = write(tmp_path / "train.parquet", rows + verl_rows([("What is 9+9?", "18")], source="mine", messages=True))
    val = write(tmp_path / "val.parquet", verl_rows([("What is 2+3?", "5")], source="mine"))

    def bound():
        task = _build({"train_files": [train], "val_files": [val]}, seed=3)
        task.bind_tokenizer(chat_tokenizer)
        return task

    uninterrupted = bound()
    assert uninterrupted.data_sources() == {"openai/gsm8k": 7, "mine": 2}
    drawn = [uninterrupted.train_prompts(step, 3) for step in range(1, 7)]     # 18 prompts: over two epochs
    first = bound()
    for step in range(1, 4):
        first.train_prompts(step, 3)
    state = json.loads(json.dumps(first.state_dict()))       # as a checkpoint stores it
    resumed = bound()
    resumed.load_state_dict(state)
    assert [resumed.train_prompts(step, 3) for step in range(4, 7)] == drawn[3:]


def test_prompts_before_the_tokenizer_is_bound_are_refused(tmp_path):
    task = _build({"train_files": [write(tmp_path / "t.parquet", verl_rows([("1+1=", "2")]))]}, seed=0)
    with pytest.raises(RuntimeError, match="bind_tokenizer first"):
        task.train_prompts(0, 1)


@pytest.mark.slow
@pytest.mark.e2e
def test_addition_as_verl_parquet_learns_through_the_dataset_task(tmp_path, warm_start_cache):
    """The quickstart's model and warm start, its task's prompts exported as verl Parquet by `rlcore dataset task`
    (train pairs; the 200 held-out pairs as validation), 80 GRPO steps scored by the reward registered for the
    files' data_source: the training reward rises beyond noise, and so does the held-out accuracy, evaluated at 40
    and 80 (one point of an oscillating curve: +0.075 on one machine, so no fixed margin)."""
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.warm_start import starting_checkpoint

    cfg = load_config("quickstart", [f"warm_start.cache_dir={warm_start_cache}"])
    model_path = starting_checkpoint(cfg, load_plugins(["qwen3", "grpo", "vllm"]).registry)
    rlcore = [sys.executable, "-m", "rlcore.cli"]
    run_to_end(rlcore + ["dataset", "task", "addition", str(tmp_path), "--train-size=3000"])
    run_dir = tmp_path / "run"
    result = run_cli(
        rlcore + ["run", "--plugins=qwen3,grpo,vllm", "quickstart", f"model.path={model_path}", "task.name=dataset",
                  f"task.options.train_files=[{tmp_path / 'train.parquet'}]",
                  f"task.options.val_files=[{tmp_path / 'val.parquet'}]", "task.options.chat_template=false",
                  "trainer.steps=80", "trainer.eval_every=40", "run.progress=false", f"run.dir={run_dir}"],
        ENV, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if "eval/rlcore/addition/mean@1" in h] == [40, 80]
    assert "reward/exact_match/mean" in history[0]
    # the training reward rises beyond noise: z 2.4 on an Intel machine (0.36 -> 0.44; its curve rises in the first
    # 20 steps and then levels off), over 3 on an AMD one
    first, last, z = reward_gain(history)
    assert z > 2, (first, last, z)
    assert summary["eval_accuracy_after"] > summary["eval_accuracy_before"], summary
