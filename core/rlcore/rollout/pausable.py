"""An engine that can be paused for a weight push while agents have requests in flight, invisibly to them (async mode).

``pause()`` stops new requests reaching the engine until ``resume()``. Without partial rollouts it then waits for the
requests in flight to finish by themselves (the push waits for the slowest). With ``partial=True`` it aborts them; each
caller keeps what its request sampled, waits for the resume and resubmits prompt + tokens so far with the remaining
budget, to the new weights, and gets ONE completion: tokens and logprobs concatenated (aligned), the last part's finish
reason, versions (the oldest and newest weights that sampled a token of it), routed experts (each token's from the
part that first fed it: ``rlcore.routed_experts.joined``). An abort by the user is final.

Every backend is used here through abort + resubmit, since each returns an aborted request's tokens and logprobs:
vLLM (in-process ``LLMEngine``; the push resets its prefix cache, so a continuation's prefix is recomputed with the
new weights), transformers (no KV cache: every step recomputes the prefix anyway) and SGLang (its abort lands at the
scheduler's next step, so ``pause`` waits for the aborted requests to come back). A later improvement for vLLM:
0.32's in-process engine has a keep-mode pause (``LLMEngine.sleep(level=0, mode="keep")``, ``wake_up(["scheduling"])``)
that freezes requests without aborting them, saving the prefill of a resubmission, but its kept KV cache was computed
by the old weights; SGLang's ``pause_generation`` offers the same (``in_place``/``retract``).
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, replace
from time import monotonic
from typing import Any, Awaitable, Callable, Iterable, Sequence

import torch

from rlcore.routed_experts import joined
from rlcore.specs import Completion, RolloutBackend, Sampling


@dataclass
class PauseStats:
    """What the rollout worker reports as metrics: since the previous read, but ``in_flight``: now."""
    resumed_requests: int = 0   # requests resubmitted for the first time after a partial pause
    resumes: int = 0            # resubmissions in all
    max_resumes: int = 0        # the most resubmissions of one request
    in_flight: int = 0          # requests on the engine (not counting those waiting for a resume)
    idle_s: float = 0.0         # seconds with nothing on the engine, or paused


@dataclass
class _Request:
    part_id: str                # the id of the part on the engine now (the caller's id, then f"{id}/r{k}")
    resumes: int = 0
    interrupted: bool = False   # aborted by a partial pause: to resubmit
    aborted: bool = False       # aborted by the user: final


def continuation_seed(seed: int | None, resumes: int) -> int | None:
    """The seed of a request's ``resumes``-th continuation (0: the request itself): not its own seed again (that
    would replay the first part's random draws), nor ``seed + k`` (another sample's seed in a batch); 32 bits, which
    every engine takes."""
    if seed is None or resumes == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/r{resumes}".encode(), digest_size=4).digest(), "big")


class PausableEngine(RolloutBackend):
    """``engine`` behind a pause; see the module docstring. Use it from one event loop."""

    def __init__(self, engine: RolloutBackend, partial: bool):
        self.engine, self.partial = engine, partial
        self._stats = PauseStats()
        self._paused = False
        self._requests: dict[str, _Request] = {}
        self._running: set[str] = set()     # caller ids whose part is on the engine
        self._changed = asyncio.Event()     # set (and replaced) when a waiter may go on: see _pulse
        self._idle_since: float | None = monotonic()

    async def generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str) -> Completion:
        return await self._generate(tokens, sampling, seed, request_id, self.engine.generate)

    async def generate_with_images(self, tokens: list[int], images: Sequence[Any], sampling: Sampling,
                                   seed: int | None, request_id: str) -> Completion:
        return await self._generate(tokens, sampling, seed, request_id,
                                    lambda *request: self.engine.generate_with_images(request[0], images,
                                                                                      *request[1:]))

    async def _generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str,
                        submit: Callable[[list[int], Sampling, int | None, str], Awaitable[Completion]]
                        ) -> Completion:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight: give each request its own id")
        request = self._requests[request_id] = _Request(request_id)
        parts: list[Completion] = []
        try:
            while True:
                await self._until(lambda: not self._paused or request.aborted)
                if request.aborted:
                    return _joined(request_id, parts, "abort", self.engine.version)
                if parts:       # resubmitted after a partial pause
                    self._count_resume(request)
                    request.part_id = f"{request_id}/r{request.resumes}"
                sampled = [t for part in parts for t in part.tokens]
                self._start(request_id)
                try:
                    part = await submit(
                        tokens + sampled, replace(sampling, max_tokens=sampling.max_tokens - len(sampled),
                                                     min_tokens=max(0, sampling.min_tokens - len(sampled))),
                        continuation_seed(seed, request.resumes), request.part_id)
                finally:
                    self._end(request_id)
                parts.append(part)
                if not (part.finish_reason == "abort" and request.interrupted and not request.aborted):
                    return _joined(request_id, parts, part.finish_reason, self.engine.version)
                if len(sampled) + len(part.tokens) >= sampling.max_tokens:
                    return _joined(request_id, parts, "length", self.engine.version)
                request.interrupted = False
        finally:
            del self._requests[request_id]

    async def pause(self) -> None:
        """Returns once nothing is on the engine: the requests in flight finished (drained) or, with ``partial``,
        aborted and back. Their callers, and every new one, wait for ``resume``."""
        self._set_paused(True)
        if self.partial:
            for request_id in list(self._running):
                request = self._requests[request_id]
                request.interrupted = True
                self.engine.abort(request.part_id)
        await self._until(lambda: not self._running)

    def resume(self) -> None:
        self._set_paused(False)
        self._pulse()

    def abort(self, request_id: str) -> None:
        """Final, paused or not: the caller gets what was sampled so far, finish reason "abort"."""
        request = self._requests.get(request_id)
        if request is None:
            return
        request.aborted = True
        if request_id in self._running:
            self.engine.abort(request.part_id)
        else:
            self._pulse()       # it may be waiting for a resume

    def stats(self) -> PauseStats:
        """The counters since the previous read, which restart from zero."""
        self._tick()
        stats, self._stats = replace(self._stats, in_flight=len(self._running)), PauseStats()
        return stats

    # ----------------------------------------------------------------------------------------------------------------
    # Bookkeeping.

    def _count_resume(self, request: _Request) -> None:
        request.resumes += 1
        self._stats.resumes += 1
        self._stats.resumed_requests += request.resumes == 1
        self._stats.max_resumes = max(self._stats.max_resumes, request.resumes)

    def _start(self, request_id: str) -> None:
        self._running.add(request_id)
        self._tick()

    def _end(self, request_id: str) -> None:
        self._running.discard(request_id)
        self._tick()
        if not self._running:
            self._pulse()

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        self._tick()

    def _tick(self) -> None:
        """After a change of state: add the time since the previous change if the engine was idle in it, and note
        whether it is idle from now on."""
        now = monotonic()
        if self._idle_since is not None:
            self._stats.idle_s += now - self._idle_since
        self._idle_since = now if self._paused or not self._running else None

    def _pulse(self) -> None:
        """Wake every waiter to check its condition again. One event for all: pauses are rare, and a per-waiter
        future would need the same bookkeeping of who waits."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    # ----------------------------------------------------------------------------------------------------------------
    # The rest is the engine's.

    # read-only: the engine's own (RolloutBackend declares them as plain attributes, which engines set)
    @property
    def version(self) -> int:  # type: ignore[override]
        return self.engine.version

    @property
    def can_release_memory(self) -> bool:  # type: ignore[override]
        return self.engine.can_release_memory

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The caller pauses first, so that no request spans the push unrecorded."""
        self.engine.update_weights(named_tensors, version)

    def load_adapters(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """As ``update_weights``: the caller pauses first."""
        self.engine.load_adapters(tensors, config, version)

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        return self.engine.score(sequences, start)

    def score_with_images(self, sequences: Sequence[list[int]], start: Sequence[int],
                          images: Sequence[Sequence[Any]]) -> list[list[float]]:
        return self.engine.score_with_images(sequences, start, images)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self, what: str) -> None:
        self.engine.resume_memory(what)

    def stop(self) -> None:
        self.engine.stop()


def _joined(request_id: str, parts: list[Completion], finish_reason: str, version: int) -> Completion:
    """One completion of a request's parts. Its first version is that of the first part with a token (a part aborted
    before sampling any saw no weights), so a trajectory is not counted staler than the weights that sampled it."""
    sampled = [part for part in parts if part.tokens] or parts
    first, last = (sampled[0].versions[0], parts[-1].versions[1]) if parts else (version, version)
    routes = sampled[0].routed_experts if sampled else None
    for part in sampled[1:]:      # each part was sent the tokens before it again: their routes are the first part's
        routes = joined(routes, part.routed_experts)
    return Completion(request_id, [t for part in parts for t in part.tokens],
                      [lp for part in parts for lp in part.logprobs], finish_reason, (first, last), routes)
