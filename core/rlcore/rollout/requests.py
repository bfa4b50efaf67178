"""Many requests to one engine at once: how a caller holding a batch of prompts (the colocated source, the engine
checks) uses the per-request contract, leaving the batching to the engine's scheduler.

Sample j of prompt i is seeded ``seeds[i] + j`` (vLLM's own rule for the n samples of a seeded request, so a batch
sent as single requests samples what one request for n did) and has the request id ``f"{tag}-{i}-{j}"``."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence, TypeVar

from rlcore.specs import Agent, Completion, RolloutBackend, Sampling
from rlcore.trajectory import Trajectory, episode_samples

T = TypeVar("T")


def run(awaitable: Awaitable[T]) -> T:
    """Run to completion on this thread's event loop, which is kept: an engine may bind to the loop it was built on
    (SGLang's does), so every call from this thread must use the same one."""
    try:
        loop = asyncio.get_event_loop()
    except RuntimeError:                # a thread that has none yet
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
    return loop.run_until_complete(awaitable)


def _all_at_once(prompts: Sequence[list[int]], n: int, seeds: Sequence[int] | None, tag: str,
                 request: Callable[[int, list[int], int | None, str], Awaitable[T]]) -> list[list[T]]:
    """``request(i, prompt, seed, request_id)`` for every sample of every prompt, all in flight together."""
    async def gather() -> list[T]:
        return await asyncio.gather(*(request(i, list(prompt), None if seeds is None else seeds[i] + j,
                                              f"{tag}-{i}-{j}")
                                      for i, prompt in enumerate(prompts) for j in range(n)))
    flat = run(gather())
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def sample(engine: RolloutBackend, prompts: Sequence[list[int]], n: int, sampling: Sampling,
           seeds: Sequence[int] | None = None, tag: str = "sample") -> list[list[Completion]]:
    """``n`` completions of every prompt, in prompt order."""
    return _all_at_once(prompts, n, seeds, tag, lambda i, prompt, seed, rid: engine.generate(prompt, sampling, seed,
                                                                                             rid))


def episodes(agent: Agent, engine: RolloutBackend, prompts: Sequence[list[int]], metadata: Sequence[dict], n: int,
             sampling: Sampling, seeds: Sequence[int] | None = None, tag: str = "episode") -> list[list[Trajectory]]:
    """``n`` episodes of ``agent`` from every prompt (with its row's metadata), in prompt order: each prompt's
    group holds its episodes' samples (one each, unless an agent split an episode)."""
    groups = _all_at_once(prompts, n, seeds, tag, lambda i, prompt, seed, rid: agent.run(prompt, metadata[i], engine,
                                                                                         sampling, seed, rid))
    return [[t for result in group for t in episode_samples(result)] for group in groups]
