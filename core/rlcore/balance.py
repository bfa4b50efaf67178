"""Splitting sequences of very different lengths so that work is even: into data-parallel shares of nearly equal
token counts (``balanced_partition``), and into micro-batches that fit a token budget with little padding
(``token_budget_micro_batches``), the same number on every data-parallel rank (``split_to_count``: a pipeline
schedule and the gradient all-reduce need every rank to run the same number of micro-batches).

Pure functions over lengths; they return indices into the given list, each index exactly once.
"""
from __future__ import annotations

import heapq
import itertools


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups whose sums are nearly equal: the largest differencing method
    (Karmarkar–Karp) for k parts. Every partial solution is k subsets; the two whose sums spread most are merged, the
    heaviest subset of one with the lightest of the other, until one solution is left. Ties keep index order, so the
    result is deterministic; each group lists its indices in ascending order."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    order = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, length in enumerate(lengths):
        subsets = [(length, [i])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-length, next(order), subsets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(order), merged))
    groups = [sorted(indices) for _, indices in heap[0][2]]
    return sorted(groups, key=lambda g: g[0] if g else len(lengths))


def token_budget_micro_batches(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Indices of ``lengths`` in micro-batches whose padded size (rows x longest row) stays within ``max_tokens``:
    sequences taken longest first, so each micro-batch holds rows of similar length and padding stays small. A
    sequence longer than the budget gets a micro-batch of its own. ``packed`` (sequences end to end, no padding):
    the sum of the lengths stays within the budget instead, each sequence going to the first micro-batch with room
    (first fit decreasing)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[int]] = []
    used: list[int] = []         # packed: tokens in each micro-batch
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if packed:
            fits = [b for b, n in enumerate(used) if n + lengths[i] <= max_tokens]
            if fits:
                batches[fits[0]].append(i)
                used[fits[0]] += lengths[i]
                continue
            used.append(lengths[i])
            batches.append([i])
        elif batches and (len(batches[-1]) + 1) * longest <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
            longest = lengths[i]
    return batches


def split_to_count(batches: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """``batches`` split further until there are ``count`` of them (the most any data-parallel rank has): the
    micro-batch with the most padded tokens is halved each time; where no micro-batch has two rows left, empty
    ones fill up the count (a rank then runs a micro-batch that contributes nothing)."""
    if count < len(batches):
        raise ValueError(f"cannot merge {len(batches)} micro-batches into {count}")
    batches = [list(b) for b in batches]
    while len(batches) < count:
        splittable = [b for b in batches if len(b) > 1]
        if not splittable:
            batches += [[] for _ in range(count - len(batches))]
            break
        widest = max(splittable, key=lambda b: len(b) * max(lengths[i] for i in b))
        half = len(widest) // 2
        batches.remove(widest)
        batches += [widest[:half], widest[half:]]
    return batches
