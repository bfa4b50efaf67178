"""The typed things the tools agent's extension points take (``hookspecs``). Plugins construct these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment a tool-using agent talks to. ``make(options)`` returns a fresh environment for one episode
    (``options``: the run's ``agent.options``): an object with ``reset(**row) -> str | None`` (the episode's task
    row; an optional first observation) whose public, type-hinted, documented methods are its tools, and optionally
    ``reward() -> float | dict[str, float]`` (read when the episode ends, for the ``environment`` reward)."""
    name: str
    make: Callable[[dict], Any]
    description: str = ""


@dataclass(frozen=True)
class ToolParserSpec:
    """How tool calls are written in a model's output. ``parse(text) -> list[ToolCall]`` (``rlcore_agent_tools.tools``):
    every call in one assistant turn, a malformed one as a ``ToolCall`` with ``error`` set (never an exception)."""
    name: str
    parse: Callable[[str], list]
