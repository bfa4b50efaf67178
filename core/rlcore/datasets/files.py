"""Prompt files as records: Parquet (pyarrow), JSON Lines and JSON arrays.

verl's RL datasets are Parquet files with ``data_source``, ``prompt`` (a list of chat messages),
``reward_model.ground_truth`` and ``extra_info``; those are the default columns, so such a file is read unchanged.
Other files name their columns (``Columns``); a dotted name reaches into a struct column
(``reward_model.ground_truth``).
A prompt may be a list of {"role", "content"} messages or a plain string.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

FORMATS = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class Columns:
    """Where each field of a record is found; verl's names by default. ``source`` and ``extra`` may be absent."""
    prompt: str = "prompt"
    answer: str = "reward_model.ground_truth"
    source: str = "data_source"
    extra: str = "extra_info"
    images: str = "images"          # a list of images (verl's {bytes, path} structs, paths or bytes), if present


@dataclass
class PromptRecord:
    prompt: str | list[dict]        # plain text, or chat messages [{"role": ..., "content": ...}]
    answer: Any                     # the ground truth the reward compares with
    source: str                     # the data source (selects the reward when rewards dispatch by source)
    extra: dict = field(default_factory=dict)
    origin: str = ""                # "<file>:<row>", for messages about this record
    images: list = field(default_factory=list)    # in the order of the prompt's <image> tags


def read_prompt_files(paths: list[str], columns: Columns = Columns(), default_source: str = "") -> list[PromptRecord]:
    """Every row of every file, in order. Each mistake (a missing or unreadable file, an unknown format, a missing
    column) raises one ConfigError that names the file and what to do."""
    if not paths:
        raise ConfigError("no prompt files given (task.options.train_files is empty)")
    return [record for path in paths for record in _read_file(path, columns, default_source)]


def read_rows(path: str, what: str = "prompt file") -> list[dict]:
    """A file's rows as dicts; a missing, unreadable, empty or unknown-format file raises one ConfigError naming it
    (as ``what``)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ConfigError(f"{what} {path!r}: unknown format {suffix or '(no suffix)'!r}; use one of "
                          f"{', '.join(FORMATS)}")
    start = time.perf_counter()
    try:
        rows = _rows(path, suffix)
    except Exception as e:
        raise ConfigError(f"{what} {path!r} cannot be read as {suffix[1:]}: {type(e).__name__}: {e}") from e
    if not rows:
        raise ConfigError(f"{what} {path!r} has no rows")
    print(f"rlcore: read {len(rows)} rows from {path} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return rows


def _read_file(path: str, columns: Columns, default_source: str) -> list[PromptRecord]:
    path = os.path.expanduser(path)
    rows = read_rows(path)
    present = sorted({key for row in rows[:1] for key in row})
    for role, name in (("prompt", columns.prompt), ("answer", columns.answer)):
        if lookup(rows[0], name) is MISSING:
            raise ConfigError(f"prompt file {path!r} has no column {name!r} for the {role} "
                              f"(task.options.{role}_key); its columns are {present}")
    return [_record(row, columns, default_source, f"{path}:{i}") for i, row in enumerate(rows)]


def _rows(path: str, suffix: str) -> list[dict]:
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if suffix == ".jsonl":
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ValueError("a .json prompt file holds one array of objects (use .jsonl for one object per line)")
    return data


class _Missing:
    pass


MISSING = _Missing()     # what ``lookup`` returns for a column a row lacks


def lookup(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _record(row: dict, columns: Columns, default_source: str, origin: str) -> PromptRecord:
    prompt = lookup(row, columns.prompt)
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt))):
        raise ConfigError(f"{origin}: the prompt ({columns.prompt!r}) is neither text nor a list of "
                          f"{{'role', 'content'}} messages: {str(prompt)[:120]!r}")
    source, extra, images = lookup(row, columns.source), lookup(row, columns.extra), lookup(row, columns.images)
    if images is MISSING or images is None:
        images = []
    elif not isinstance(images, list):
        raise ConfigError(f"{origin}: the images ({columns.images!r}) are a {type(images).__name__}, not a list of "
                          f"images (one per <image> tag of the prompt)")
    return PromptRecord(prompt=prompt, answer=lookup(row, columns.answer),
                        source=default_source if source is MISSING or source is None else str(source),
                        extra=extra if isinstance(extra, dict) else {}, origin=origin, images=images)
