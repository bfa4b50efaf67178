"""Typed registries filled from the registration hooks. A name claimed twice is an error naming both plugins.

The core's kinds are typed fields; a kind a plugin declares with its own hookspecs (``rlcore_add_hookspecs``, e.g.
rlcore-agent-tools' environments) is a table of its own, ``Registry.table(kind)``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import PluginError
from rlcore.specs import (AgentSpec, Algorithm, CommandSpec, DialectSpec, ModelSpec, OptimizerSpec, RewardSpec,
                          RolloutBackendSpec, TaskSpec)

# registry attribute -> registration hook
KINDS = {
    "models": "rlcore_models",
    "algorithms": "rlcore_algorithms",
    "rollout_backends": "rlcore_rollout_backends",
    "agents": "rlcore_agents",
    "optimizers": "rlcore_optimizers",
    "rewards": "rlcore_rewards",
    "tasks": "rlcore_tasks",
    "loggers": "rlcore_loggers",
    "commands": "rlcore_commands",
    "run_dialects": "rlcore_run_dialects",
}


@dataclass
class Registry:
    models: dict[str, ModelSpec] = field(default_factory=dict)
    algorithms: dict[str, Algorithm] = field(default_factory=dict)
    rollout_backends: dict[str, RolloutBackendSpec] = field(default_factory=dict)
    agents: dict[str, AgentSpec] = field(default_factory=dict)
    optimizers: dict[str, OptimizerSpec] = field(default_factory=dict)
    rewards: dict[str, RewardSpec] = field(default_factory=dict)
    tasks: dict[str, TaskSpec] = field(default_factory=dict)
    loggers: dict[str, type] = field(default_factory=dict)
    commands: dict[str, CommandSpec] = field(default_factory=dict)
    run_dialects: dict[str, DialectSpec] = field(default_factory=dict)
    plugin_kinds: dict[str, dict[str, Any]] = field(default_factory=dict)   # kinds plugins declare: kind -> table
    # (kind, name) -> label of the plugin that registered it, e.g. "qwen3 (rlcore-model-qwen3 0.1.0)"
    owners: dict[tuple[str, str], str] = field(default_factory=dict)

    def table(self, kind: str) -> dict[str, Any]:
        """Name -> item of one kind (empty for a plugin's kind whose plugin is not loaded)."""
        return getattr(self, kind) if kind in KINDS else self.plugin_kinds.get(kind, {})

    def add(self, kind: str, item: Any, owner: str) -> None:
        name = item.name
        table = getattr(self, kind) if kind in KINDS else self.plugin_kinds.setdefault(kind, {})
        if name in table:
            raise PluginError(f"two plugins register the {kind[:-1].replace('_', ' ')} {name!r}: "
                              f"{self.owners[(kind, name)]} and {owner}. Uninstall one, or select plugins with "
                              f"--plugins so that only one of them loads.")
        table[name] = item
        self.owners[(kind, name)] = owner

    def get(self, kind: str, name: str) -> Any:
        table = self.table(kind)
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise PluginError(f"no {kind[:-1].replace('_', ' ')} named {name!r} is registered (registered: {known}). "
                              f"Install the plugin that provides it, or check --plugins.")
        return table[name]

    def registered_by(self, owner: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for (kind, name), who in self.owners.items():
            if who == owner:
                out.setdefault(kind, []).append(name)
        return out
