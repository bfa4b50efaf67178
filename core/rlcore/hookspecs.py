"""Every extension point of rlcore, as typed pluggy hook specs. This file is the single list of them.

Registration hooks return a list of objects; the core collects them into typed registries (``rlcore.registry``)
and refuses a name claimed twice, naming both plugins. Lifecycle hooks are called with keyword arguments and every
implementation runs (their return values are ignored), so a plugin that only observes needs no core change.
"""
# Hook specs are signatures with a docstring and no body:
# mypy: disable-error-code="empty-body"
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from rlcore.specs import (AgentSpec, Algorithm, CommandSpec, DialectSpec, Logger, ModelSpec, OptimizerSpec,
                              RewardSpec, RolloutBackendSpec, TaskSpec)

PROJECT = "rlcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- plugins' own hooks --------------------------------------------------------------------------------------------

@hookspec(historic=True)
def rlcore_add_hookspecs(pluginmanager: pluggy.PluginManager) -> dict[str, str] | None:
    """Called as each plugin registers (pytest_addhooks' way): a plugin with extension points of its own adds their
    specs, ``pluginmanager.add_hookspecs(module)``, and returns the registry kinds its registration hooks fill, kind
    -> hook name (e.g. ``{"environments": "rlcore_environments"}``); the registry collects them as the core's kinds
    (``Registry.table(kind)``)."""


# --- registration ---------------------------------------------------------------------------------------------------

@hookspec
def rlcore_models() -> list[ModelSpec]:
    """Model families: HF config -> Megatron TransformerConfig, layer spec, HF <-> Megatron weight rules."""


@hookspec
def rlcore_algorithms() -> list[Algorithm]:
    """RL algorithms: advantage estimator, policy loss, config dataclass, whether a reference model is needed."""


@hookspec
def rlcore_rollout_backends() -> list[RolloutBackendSpec]:
    """Generation engines (vLLM, SGLang): a name and a factory for a ``RolloutBackend``."""


@hookspec
def rlcore_agents() -> list[AgentSpec]:
    """Agents: how an episode uses the engine (``single_turn`` is built in; ``tools``: rlcore-agent-tools)."""


@hookspec
def rlcore_optimizers() -> list[OptimizerSpec]:
    """Optimizer builders for the Megatron actor."""


@hookspec
def rlcore_rewards() -> list[RewardSpec]:
    """Reward functions: ``fn(prompts, responses, metadata) -> list[float]`` or named components."""


@hookspec
def rlcore_tasks() -> list[TaskSpec]:
    """Prompt sources with a default reward and (optionally) a tokenizer for built-in tiny models."""


@hookspec
def rlcore_loggers() -> list[type[Logger]]:
    """Metric sink classes (console, JSONL, ...), each with a class attribute ``name``."""


@hookspec
def rlcore_commands() -> list[CommandSpec]:
    """Subcommands of ``rlcore`` (``rlcore verl translate``: rlcore-verl). The CLI loads the plugins before it parses
    the command line, so that these appear in ``rlcore --help``."""


@hookspec
def rlcore_run_dialects() -> list[DialectSpec]:
    """Flags of ``rlcore run`` that read another framework's keys (``--verl``: rlcore-verl)."""


# --- lifecycle (observe only; every implementation is called) -------------------------------------------------------

@hookspec
def rlcore_configure(config: Any) -> None:
    """Called once with the resolved, validated config before any model is built."""


@hookspec
def rlcore_step_begin(step: int) -> None:
    """Called at the start of every training step."""


@hookspec
def rlcore_rollout_end(step: int, batch: Any) -> None:
    """Called after rewards are computed for a step's rollout batch."""


@hookspec
def rlcore_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called at the end of every training step with that step's metrics."""


@hookspec
def rlcore_checkpoint_saved(step: int, path: str) -> None:
    """Called after a checkpoint or export has been written."""
