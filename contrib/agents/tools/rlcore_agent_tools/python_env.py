"""The ``python`` environment: one tool, ``python(code)``, the model's code run in the process jail (``jail``);
``agent.options`` are its ``Limits``."""
from __future__ import annotations

from typing import Any

from rlcore_agent_tools.jail import Limits, run_python
from rlcore_agent_tools.specs import EnvironmentSpec


class PythonEnvironment:
    """An environment with one tool, ``python``: the model's code runs in the sandbox (``run_python``), a fresh
    subprocess per call, so nothing carries over between calls."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()

    def reset(self, **row: Any) -> str | None:
        """Nothing to prepare: each call starts from a fresh interpreter."""
        return None

    def python(self, code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: a complete Python program; print what you want to see (stdout and stderr are returned).
        """
        return run_python(code, self.limits).as_observation()


def _make_python_environment(options: dict) -> PythonEnvironment:
    from rlcore.config import bind_plugin_section

    return PythonEnvironment(bind_plugin_section("agent.options", options, Limits))


PYTHON = EnvironmentSpec("python", _make_python_environment,
                         "a python(code) tool, run in the sandbox; agent.options are its Limits")
