"""Prompt files in verl's Parquet schema (``data_source``, ``prompt`` as chat messages or text, ``ability``,
``reward_model.{style,ground_truth}``, ``extra_info``), written from GSM8K's public JSONL or from a registered task,
so that the same files serve rlcore's dataset task and verl alike. ``rlcore dataset ...`` runs these."""
from __future__ import annotations

import json
import os
import re

from rlcore.errors import ConfigError
from rlcore.specs import Task

GSM8K_SOURCE = "openai/gsm8k"
# the instruction verl's GSM8K recipe appends to each question, so that the answer ends in '#### <number>'
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_SOLUTION = re.compile(r"####\s*(-?[0-9.,]+)\s*$")


def gsm8k_rows(jsonl_path: str, split: str) -> list[dict]:
    """GSM8K's ``{"question", "answer"}`` lines (the answer's last line is ``#### <number>``) as verl rows."""
    rows: list[dict] = []
    try:
        with open(os.path.expanduser(jsonl_path), encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise ConfigError(f"GSM8K file {jsonl_path!r}: {e.strerror}") from e
    for n, line in lines:
        try:
            item = json.loads(line)
            question, answer = item["question"], item["answer"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{jsonl_path}:{n}: not a GSM8K line ({{'question': ..., 'answer': ...}}): "
                              f"{type(e).__name__}: {e}") from e
        solution = _GSM8K_SOLUTION.search(answer)
        if solution is None:
            raise ConfigError(f"{jsonl_path}:{n}: the answer does not end in '#### <number>': {answer[-80:]!r}")
        rows.append({"data_source": GSM8K_SOURCE,
                     "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": solution[1].replace(",", "")},
                     "extra_info": {"split": split, "index": len(rows), "answer": answer, "question": question}})
    return rows


def task_rows(task: Task, source: str, count: int, held_out: bool = False) -> list[dict]:
    """A task's training prompts (``count`` of them, as step 0 draws them) or its held-out set as verl rows; the
    prompt stays plain text (no chat template), the ground truth is the metadata's ``answer``."""
    examples = task.eval_prompts() if held_out else task.train_prompts(0, count)
    return [{"data_source": meta.get("data_source", source), "prompt": prompt, "ability": "rlcore",
             "reward_model": {"style": "rule", "ground_truth": str(meta["answer"])},
             "extra_info": {"index": i, "split": "test" if held_out else "train"}}
            for i, (prompt, meta) in enumerate(examples)]


def write_parquet(rows: list[dict], path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ConfigError(f"nothing to write to {path}: no rows")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
