"""Correctness check of a weight sync: the rollout engine and the actor must assign the same logprobs to the same
tokens. Teacher-forced on fixed sequences, so it tests weights and numerics, not sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from rlcore.data import Batch, build_sequences
from rlcore.errors import RlcoreError


@dataclass
class LogprobComparison:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int


def compare_logprobs(actor, rollout, prompts: Sequence[list[int]], responses: Sequence[list[int]],
                     pad_id: int) -> LogprobComparison:
    """Logprobs of ``responses`` given ``prompts`` from the engine (``rollout.score``) and the actor."""
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
    engine = rollout.score(sequences, [len(p) for p in prompts])
    batch = Batch(build_sequences(prompts, responses, pad_id, response_logprobs=engine))
    return compared(actor.logprobs(batch), batch)


def compared(actor_logprobs: torch.Tensor, scored: Batch) -> LogprobComparison:
    """The actor's logprobs [N, S] against an engine's, ``scored``'s ``rollout_logprobs`` (``build_sequences`` of the
    same sequences with ``response_logprobs``), over the response tokens."""
    mask = scored["response_mask"].bool()
    diff = (actor_logprobs[mask] - scored["rollout_logprobs"][mask]).abs()
    return LogprobComparison(float(diff.max()), float(diff.mean()), int(mask.sum()))


def worst(results: Iterable[LogprobComparison]) -> LogprobComparison:
    """The comparison with the largest difference (a NaN counts as the largest: it must fail the check)."""
    return max(results, key=lambda r: (math.isnan(r.max_abs_diff), r.max_abs_diff))


def check_logprobs(actor, rollout, prompts, responses, pad_id: int, tolerance: float) -> LogprobComparison:
    """``compare_logprobs`` that raises when the largest difference exceeds ``tolerance``."""
    return raise_if_disagree(compare_logprobs(actor, rollout, prompts, responses, pad_id), tolerance)


def raise_if_disagree(result: LogprobComparison, tolerance: float) -> LogprobComparison:
    if not result.max_abs_diff <= tolerance:
        raise RlcoreError(f"rollout engine and actor disagree after a weight sync: max |logprob diff| "
                          f"{result.max_abs_diff:.3g} > tolerance {tolerance:g} over {result.tokens} tokens "
                          f"(mean {result.mean_abs_diff:.3g}). The weight conversion or sync is wrong.")
    return result


def fixed_probe(vocab_size: int, count: int = 8, prompt_len: int = 6, response_len: int = 6,
                seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """A fixed batch of random token sequences for the check (independent of any task)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab_size, (count, prompt_len), generator=g).tolist()
    responses = torch.randint(1, vocab_size, (count, response_len), generator=g).tolist()
    return prompts, responses
