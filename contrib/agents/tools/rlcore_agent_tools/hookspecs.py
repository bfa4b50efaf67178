"""The extension points of rlcore-agent-tools, added to rlcore's plugin manager as the plugin registers
(``rlcore_add_hookspecs``), as pytest plugins add theirs: environments and tool-call parsers for the ``tools`` agent.
Other plugins implement them with rlcore's ``hookimpl`` (one project, ``rlcore``)."""
# Hook specs are signatures with a docstring and no body:
# mypy: disable-error-code="empty-body"
from __future__ import annotations

from rlcore.hookspecs import hookspec
from rlcore_agent_tools.specs import EnvironmentSpec, ToolParserSpec

# registry kind -> registration hook (``Registry.table(kind)``)
KINDS = {"environments": "rlcore_environments", "tool_parsers": "rlcore_tool_parsers"}


@hookspec
def rlcore_environments() -> list[EnvironmentSpec]:
    """Environments for the ``tools`` agent: a class per episode whose documented methods are tools."""


@hookspec
def rlcore_tool_parsers() -> list[ToolParserSpec]:
    """How tool calls are written in a model's output (``hermes``: Qwen's ``<tool_call>{json}</tool_call>``, this
    plugin's)."""
