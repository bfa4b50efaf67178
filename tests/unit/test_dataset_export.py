"""`rlcore dataset`: GSM8K's public JSONL (through scripts/prepare_gsm8k.sh) and a registered task's prompts as verl-
schema Parquet files that the dataset task reads unchanged and the rewards score by their data_source."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from runs import run_cli

from rlcore.config import load_config
from rlcore.datasets import read_prompt_files
from rlcore.plugins import load_plugins
from rlcore.rewards import build_rewards

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RLCORE = [sys.executable, "-m", "rlcore.cli"]
GSM8K_LINES = [  # as in GSM8K's train.jsonl: the worked answer ends in '#### <number>'
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A shop had 1,250 pens and sold 50. How many are left?", "answer": "1,250-50 = 1,200\n#### 1,200"},
]


def test_gsm8k_jsonl_becomes_verl_parquet_scored_by_the_gsm8k_reward(tmp_path):
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in GSM8K_LINES))
    result = subprocess.run([os.path.join(REPO, "scripts", "prepare_gsm8k.sh"), str(tmp_path), str(tmp_path / "out")],
                            capture_output=True, text=True, env={**os.environ, "RLCORE": " ".join(RLCORE)})
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "A shop had 1,250 pens and sold 50. How many are left? Let's think "
                                               "step by step and output the final answer after \"####\"."}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1200"},
        "extra_info": {"split": "test", "index": 1, "answer": GSM8K_LINES[1]["answer"],
                       "question": GSM8K_LINES[1]["question"]}}
    records = read_prompt_files([str(tmp_path / "out" / "train.parquet")])        # verl's columns: no mapping
    sources = {r.source: 1 for r in records}
    reward = build_rewards(load_config(None).task, "", sources, load_plugins(["grpo"]).registry)
    meta = [{"answer": r.answer, "data_source": r.source} for r in records]
    assert reward([line["answer"] for line in GSM8K_LINES], meta).total.tolist() == [1.0, 1.0]
    assert reward(["#### 71", "no final answer"], meta).total.tolist() == [0.0, 0.0]


def test_a_line_that_is_not_gsm8k_is_refused_naming_it(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps(GSM8K_LINES[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    result = run_cli(RLCORE + ["dataset", "gsm8k", str(bad), str(tmp_path / "x.parquet")])
    assert result.returncode == 2
    assert result.stderr.strip() == (f"rlcore: error: {bad}:2: the answer does not end in '#### <number>': "
                                     "'no marker'")
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("options", [[], ["digits=1", "eval_size=20"]])
def test_a_task_is_exported_as_train_and_val_files(tmp_path, options):
    result = run_cli(RLCORE + ["dataset", "task", "addition", str(tmp_path), "--train-size", "50", *options])
    assert result.returncode == 0, result.stderr
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "val.parquet").to_pylist()
    assert len(train) == 50 and len(val) == (20 if options else 200)
    a, b = map(int, val[0]["prompt"][:-1].split("+"))
    assert val[0]["reward_model"]["ground_truth"] == str(a + b) and val[0]["data_source"] == "rlcore/addition"
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}   # the held-out pairs stay held out
