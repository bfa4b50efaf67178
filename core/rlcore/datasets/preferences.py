"""Preference pairs for a reward model: (prompt, chosen, rejected) from files (Parquet, JSON Lines, JSON; the
responses as text, or as chat messages the reward model's chat template renders) or made by the task, and the
token sequences the reward model scores: prompt and response, ending in the end-of-sequence token as the policy's
finished episodes do."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.data import Batch
from rlcore.datasets.files import MISSING, lookup, read_rows
from rlcore.errors import ConfigError

Triple = tuple[Any, Any, Any]     # prompt (text, messages or None), chosen, rejected (text or messages)


def read_pairs(paths: list[str], prompt_key: str, chosen_key: str, rejected_key: str) -> list[Triple]:
    """Every row of every file; a file without one of the columns raises one ConfigError naming the file, the
    missing column, the key that names it and the columns it has."""
    pairs = []
    for path in paths:
        rows = read_rows(path, "preference file")
        keys = [("prompt", prompt_key)] * bool(prompt_key) + [("chosen", chosen_key), ("rejected", rejected_key)]
        for role, name in keys:
            if lookup(rows[0], name) is MISSING:
                raise ConfigError(f"preference file {path!r} has no column {name!r} for the {role} (reward_training."
                                  f"{role}_key); its columns are {sorted(rows[0])}")
        pairs += [(lookup(r, prompt_key) if prompt_key else None, lookup(r, chosen_key), lookup(r, rejected_key))
                  for r in rows]
    return pairs


def render(prompt: Any, response: Any, tokenizer) -> list[int]:
    """One side of a pair as token ids: text is the prompt followed by the response; messages (a chat) go through
    the tokenizer's chat template, the response as the assistant's turn(s). The end of sequence is appended unless
    it is there already."""
    if isinstance(response, list) or isinstance(prompt, list):
        turns = lambda x: x if isinstance(x, list) else ([] if x is None  # noqa: E731
                                                         else [{"role": "user", "content": x}])
        answer = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        ids = tokenizer.apply_chat_template(turns(prompt) + answer, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    else:
        ids = tokenizer.encode((prompt or "") + response, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return ids if ids and ids[-1] == eos else ids + [eos]


@dataclass
class TokenizedPairs:
    chosen: list[list[int]]
    rejected: list[list[int]]
    too_long: int               # pairs left out: a side longer than the model's context (counted, reported)

    def __len__(self) -> int:
        return len(self.chosen)


def tokenize_pairs(pairs: list[Triple], tokenizer, context: int) -> TokenizedPairs:
    chosen, rejected, too_long = [], [], 0
    for prompt, good, bad in pairs:
        a, b = render(prompt, good, tokenizer), render(prompt, bad, tokenizer)
        if max(len(a), len(b)) > context:
            too_long += 1
            continue
        chosen.append(a)
        rejected.append(b)
    return TokenizedPairs(chosen, rejected, too_long)


def pair_batch(pairs: TokenizedPairs, index: list[int], pad_id: int | None) -> Batch:
    """The pairs ``index`` names as rows chosen, rejected, chosen, rejected... (``score_batch`` rows). The rows
    carry no lengths, so data-parallel shares and fixed-size micro-batches stay contiguous: with an even number of
    rows each, a pair never splits."""
    from rlcore.megatron.reward_model import score_batch

    batch = score_batch([s for i in index for s in (pairs.chosen[i], pairs.rejected[i])], pad_id)
    del batch.tensors["prompt_len"], batch.tensors["response_len"]
    return batch
