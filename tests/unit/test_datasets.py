"""Prompt files (verl's Parquet schema, JSONL / JSON with a column mapping) and the per-epoch sampler."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.datasets import Columns, EpochSampler, read_prompt_files
from rlcore.errors import ConfigError

VERL_ROWS = [  # the layout of verl's examples/data_preprocess/gsm8k.py output
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold 48 clips... Let's think step by step."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 1}},
]


def test_verl_parquet_is_read_unchanged(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    records = read_prompt_files([str(path)])
    assert [r.answer for r in records] == ["72", "5"] and {r.source for r in records} == {"openai/gsm8k"}
    assert records[1].prompt == VERL_ROWS[1]["prompt"] and records[1].extra == {"split": "train", "index": 1}
    assert records[0].origin == f"{path}:0"


def test_jsonl_and_json_with_a_column_mapping_and_plain_prompts(tmp_path):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps(rows[:1]))
    records = read_prompt_files([str(tmp_path / "a.jsonl"), str(tmp_path / "b.json")],
                                Columns(prompt="question", answer="answer"), default_source="arith")
    assert [(r.prompt, r.answer, r.source, r.extra) for r in records] == [
        ("1+1=", "2", "arith", {}), ("2+2=", "4", "arith", {}), ("1+1=", "2", "arith", {})]


@pytest.mark.parametrize("name, content, message", [
    ("missing.parquet", None, "does not exist"),
    ("prompts.csv", "a,b\n", "unknown format '.csv'; use one of .parquet, .jsonl, .json"),
    ("broken.parquet", "not parquet", "cannot be read as parquet: ArrowInvalid"),
    ("broken.jsonl", "{not json\n", "cannot be read as jsonl: JSONDecodeError"),
    ("object.json", '{"prompt": "x"}', "holds one array of objects"),
    ("empty.jsonl", "\n", "has no rows"),
    ("columns.jsonl", '{"question": "1+1=", "reward_model": {"ground_truth": "2"}}\n',
     "has no column 'prompt' for the prompt (task.options.prompt_key); its columns are ['question', 'reward_model']"),
    ("answer.jsonl", '{"prompt": "1+1="}\n', "has no column 'reward_model.ground_truth' for the answer"),
    ("shape.jsonl", '{"prompt": [{"text": "hi"}], "reward_model": {"ground_truth": "2"}}\n',
     "is neither text nor a list of {'role', 'content'} messages"),
])
def test_bad_files_fail_with_one_message_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        read_prompt_files([str(path)])
    assert str(path) in str(e.value) and message in str(e.value)


def test_no_files_is_refused():
    with pytest.raises(ConfigError, match="no prompt files"):
        read_prompt_files([])


def test_sampler_covers_each_epoch_once_in_a_seeded_order():
    sampler = EpochSampler(5, seed=3)
    first, second = sampler.take(5), sampler.take(5)
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert EpochSampler(5, seed=3).take(10) == first + second
    assert EpochSampler(5, seed=3, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_sampler_state_resumes_the_same_sequence():
    sampler = EpochSampler(7, seed=1)
    sampler.take(9)
    state = sampler.state_dict()
    rest = sampler.take(12)
    resumed = EpochSampler(7, seed=1)
    resumed.load_state_dict(state)
    assert resumed.take(12) == rest
    with pytest.raises(ValueError, match="seed 1 over 7 items"):
        EpochSampler(8, seed=1).load_state_dict(state)
