"""The requests an engine without an asyncio API of its own has in flight (vLLM's in-process engine, the
transformers backend): each caller awaits its request's completion while one stepping task of the engine appends the
tokens it samples and finishes the request — at a stop, at its length, or when aborted with what it has."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

import torch

from rlcore.specs import Completion


@dataclass
class Request:
    done: asyncio.Future
    version: int                # the weights its first token was sampled with
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    extra: Any = None           # the engine's own per-request state (the transformers backend: prompt, sampling)
    routed_experts: torch.Tensor | None = None      # the completion's, kept up to date by an engine that routes


class InFlight:
    """Requests by id, and the one task that steps the engine while any is in flight."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._stepping: asyncio.Task | None = None

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def items(self) -> Iterator[tuple[str, Request]]:
        return iter(list(self._requests.items()))

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    async def run(self, request_id: str, version: int, submit: Callable[[], object],
                  step_while_busy: Callable[[], Awaitable[None]], abort: Callable[[str], None],
                  extra: Any = None) -> Completion:
        """Add the request, ``submit`` it to the engine, start ``step_while_busy`` if it is not running, and wait
        for the completion; a caller that gives up (cancelled) aborts its request."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight: give each request its own id")
        loop = asyncio.get_running_loop()
        request = self._requests[request_id] = Request(loop.create_future(), version, extra=extra)
        try:
            submit()
        except BaseException:
            del self._requests[request_id]
            raise
        if self._stepping is None or self._stepping.done():
            self._stepping = loop.create_task(self._guarded(step_while_busy))
        try:
            return await request.done
        except asyncio.CancelledError:
            abort(request_id)
            raise

    async def _guarded(self, step_while_busy: Callable[[], Awaitable[None]]) -> None:
        try:
            await step_while_busy()
        except BaseException as error:      # every waiting caller hears of it, none hangs
            for request in self._requests.values():
                if not request.done.done():
                    request.done.set_exception(error)
            self._requests.clear()

    def finish(self, request_id: str, reason: str, version: int) -> None:
        """Hand the request its completion (``version``: the engine's weights now) with the routed experts the
        engine left on it; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None and not request.done.done():
            request.done.set_result(Completion(request_id, request.tokens, request.logprobs, reason,
                                               (request.version, version), request.routed_experts))
