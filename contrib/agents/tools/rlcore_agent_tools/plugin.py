"""Registers the tools agent with rlcore: its own hookspecs (environments, tool parsers), the ``tools`` agent, the
``calculator``, ``python`` and ``verl_tools`` environments, the ``hermes`` parser and the ``tool_arithmetic`` task."""
from rlcore.hookspecs import hookimpl
from rlcore_agent_tools import hookspecs
from rlcore_agent_tools.agent import TOOLS
from rlcore_agent_tools.hermes import HERMES
from rlcore_agent_tools.python_env import PYTHON
from rlcore_agent_tools.tasks.tool_arithmetic import CALCULATOR, TOOL_ARITHMETIC
from rlcore_agent_tools.verl_tools import VERL_TOOLS


@hookimpl
def rlcore_add_hookspecs(pluginmanager):
    pluginmanager.add_hookspecs(hookspecs)
    return hookspecs.KINDS


@hookimpl
def rlcore_agents():
    return [TOOLS]


@hookimpl
def rlcore_environments():
    return [CALCULATOR, PYTHON, VERL_TOOLS]


@hookimpl
def rlcore_tool_parsers():
    return [HERMES]


@hookimpl
def rlcore_tasks():
    return [TOOL_ARITHMETIC]
