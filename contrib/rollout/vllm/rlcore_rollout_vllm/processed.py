"""A group's requests processed once, as vLLM processes the n samples of one request.

vLLM's input processing of a request (rendering the prompt, the eos lookup, validating the sampling parameters) is
Python, ~40 us a request here: on the quickstart's batch (128 requests of up to 5 tokens on a tiny model) that was
about half of what the per-request path cost beyond the engine's own batch generate (docs/benchmarks.md,
``bench/rollout_floor.py``). The samples of a group share their prompt and sampling, so the first one's processed
request is kept and each further sample is a copy with its own id, seed and arrival time: what vLLM does for the
children of a request with ``n > 1`` (its ``ParentRequest``: a shallow copy of the request and of its sampling
parameters, the seed its own).
"""
from __future__ import annotations

import time
from copy import copy
from typing import TYPE_CHECKING, Callable, Hashable

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreRequest


class ProcessedPrompts:
    """The processed requests of the ``capacity`` (prompt, sampling, adapter) keys processed last: a group's samples
    are sent one after another, so a few dozen suffice, and a multi-turn agent's later turns (each prompt its own)
    keep no more than that many long prompts. A kept request never goes to the engine itself (vLLM rewrites the id
    of a request it admits): every request added is a copy."""

    def __init__(self, capacity: int = 64):
        self._kept: dict[Hashable, EngineCoreRequest] = {}
        self._capacity = capacity

    def request(self, request_id: str, key: Hashable, seed: int | None,
                process: Callable[[], EngineCoreRequest]) -> EngineCoreRequest:
        """The request ``request_id`` sampling with ``seed``: ``process()``'s request for ``key``, made once."""
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = process()
            if len(self._kept) > self._capacity:
                del self._kept[next(iter(self._kept))]
        request = copy(kept)
        request.request_id, request.arrival_time = request_id, time.time()
        request.sampling_params = copy(kept.sampling_params)
        request.sampling_params.seed = seed
        return request
