"""Correctness check of a weight sync: the rollout engine and the actor must assign the same logprobs to the same
tokens. Teacher-forced on fixed sequences, so it tests weights and numerics, not sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from rlcore.data import Batch, build_sequences
from rlcore.errors import RlcoreError
from rlcore.multimodal import IMAGE_INPUTS, IMAGE_TAG, ImageInputs, ImagePrompts


@dataclass
class LogprobComparison:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int


# a prompt's images in the check: (the decoded images, for the engine; their pixels, for the actor), or None
ProbeImages = Optional[tuple[list, ImageInputs]]
# what a rollout worker scores after a push: (sequences, where each response starts, each one's images or None)
Probe = tuple[list[list[int]], list[int], Optional[list[ProbeImages]]]


def compare_logprobs(actor, rollout, prompts: Sequence[list[int]], responses: Sequence[list[int]],
                     pad_id: int, images: Sequence[ProbeImages] | None = None) -> LogprobComparison:
    """Logprobs of ``responses`` given ``prompts`` (with ``images``, one entry per prompt) from the engine
    (``rollout.score``) and the actor."""
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
    engine = score(rollout, sequences, [len(p) for p in prompts], images)
    batch = probe_batch(prompts, responses, pad_id, images, engine)
    return compared(actor.logprobs(batch), batch)


def score(rollout, sequences: Sequence[list[int]], start: Sequence[int],
          images: Sequence[ProbeImages] | None) -> list[list[float]]:
    """The engine's teacher-forced logprobs, given each sequence's images where it has any."""
    if images is None:
        return rollout.score(sequences, start)
    return rollout.score_with_images(sequences, start, [own[0] if own else [] for own in images])


def probe_batch(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int,
                images: Sequence[ProbeImages] | None, engine: list[list[float]] | None = None) -> Batch:
    """The actor's batch of the check's sequences (each row's pixels in its metadata)."""
    return Batch(build_sequences(prompts, responses, pad_id, response_logprobs=engine),
                 [{IMAGE_INPUTS: own[1]} if own else {} for own in images] if images is not None else [])


def compared(actor_logprobs: torch.Tensor, scored: Batch) -> LogprobComparison:
    """The actor's logprobs [N, S] against an engine's, ``scored``'s ``rollout_logprobs`` (``build_sequences`` of the
    same sequences with ``response_logprobs``), over the response tokens."""
    mask = scored["response_mask"].bool()
    diff = (actor_logprobs[mask] - scored["rollout_logprobs"][mask]).abs()
    return LogprobComparison(float(diff.max()), float(diff.mean()), int(mask.sum()))


def with_image_prompts(probe: tuple[list[list[int]], list[list[int]]], images: ImagePrompts, seed: int = 0,
                       sizes: Sequence[tuple[int, int]] = ((56, 84), (84, 56))
                       ) -> tuple[list[list[int]], list[list[int]], list[ProbeImages]]:
    """The probe and as many more sequences as ``sizes``, each the first probe prompt then one random image of
    that size (its tokens as the model reads them) then the first prompt's response: so the check after a push
    covers the vision tower's weights and the engine's image cache."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    prompts, responses = list(probe[0]), list(probe[1])
    per_row: list[ProbeImages] = [None] * len(prompts)
    for h, w in sizes:
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        tokens, decoded, inputs = images.encode(IMAGE_TAG, [image], "the engine check's probe")
        prompts.append(list(probe[0][0]) + tokens)
        responses.append(list(probe[1][0]))
        per_row.append((decoded, inputs))
    return prompts, responses, per_row


def worst(results: Iterable[LogprobComparison]) -> LogprobComparison:
    """The comparison with the largest difference (a NaN counts as the largest: it must fail the check)."""
    return max(results, key=lambda r: (math.isnan(r.max_abs_diff), r.max_abs_diff))


def check_logprobs(actor, rollout, prompts, responses, pad_id: int, tolerance: float) -> LogprobComparison:
    """``compare_logprobs`` that raises when the largest difference exceeds ``tolerance``."""
    return raise_if_disagree(compare_logprobs(actor, rollout, prompts, responses, pad_id), tolerance)


def engines_agree(actor_logprobs, probe: tuple[list[list[int]], list[list[int]], list[ProbeImages] | None],
                  engines: list[list[list[float]]], pad_id: int, tolerance: float) -> float:
    """The largest |engine - actor| logprob over the probe's response tokens (``engines``: each engine's scores of
    them; ``actor_logprobs``: the actor's, of a probe batch); raises past ``tolerance``."""
    prompts, responses, images = probe
    actor = actor_logprobs(probe_batch(prompts, responses, pad_id, images))
    result = worst(compared(actor, probe_batch(prompts, responses, pad_id, images, scores)) for scores in engines)
    return raise_if_disagree(result, tolerance).max_abs_diff


def raise_if_disagree(result: LogprobComparison, tolerance: float) -> LogprobComparison:
    if not result.max_abs_diff <= tolerance:
        raise RlcoreError(f"rollout engine and actor disagree after a weight sync: max |logprob diff| "
                          f"{result.max_abs_diff:.3g} > tolerance {tolerance:g} over {result.tokens} tokens "
                          f"(mean {result.mean_abs_diff:.3g}). The weight conversion or sync is wrong.")
    return result


def fixed_probe(vocab_size: int, count: int = 8, prompt_len: int = 6, response_len: int = 6,
                seed: int = 0, excluded: Sequence[int] = ()) -> tuple[list[list[int]], list[list[int]]]:
    """A fixed batch of random token sequences for the check (independent of any task), without the ``excluded``
    tokens (a vision-language model's image placeholders, which need images)."""
    g = torch.Generator().manual_seed(seed)
    if not excluded:
        prompts = torch.randint(1, vocab_size, (count, prompt_len), generator=g).tolist()
        responses = torch.randint(1, vocab_size, (count, response_len), generator=g).tolist()
        return prompts, responses
    allowed = torch.tensor([i for i in range(1, vocab_size) if i not in set(excluded)])
    return (allowed[torch.randint(0, len(allowed), (count, prompt_len), generator=g)].tolist(),
            allowed[torch.randint(0, len(allowed), (count, response_len), generator=g)].tolist())
