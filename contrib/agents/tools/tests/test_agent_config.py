"""The ``agent:`` section belongs to the tools agent (issue 38): bound to its ``AgentConfig`` when the Run is built, so
a bad key or value, and an environment or parser no plugin registered, is refused in one line before any worker or
engine starts (the Run's directory is not even made), on ``rlcore run`` and on ``--dry-run`` alike. Quick: no model,
no training."""
import sys

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError, PluginError
from rlcore.plugins import load_plugins
from rlcore_agent_tools.agent import AgentConfig
from rlcore_agent_tools.metrics import agent_metrics

from runs import run_cli

PLUGINS = ["qwen3", "grpo", "vllm", "tools"]


@pytest.fixture(scope="module")
def plugins():
    return load_plugins(PLUGINS)


def tool_run(tmp_path, *overrides):
    return load_config("tool-calculator", [f"run.dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("overrides, error, line", [
    (["agent.environment=no_such_env"], PluginError,
     "no environment named 'no_such_env' is registered (registered: calculator, python, verl_tools)"),
    (["agent.parser=no_such_parser"], PluginError, "no tool parser named 'no_such_parser' is registered "
                                                   "(registered: hermes)"),
    (["agent.environment=''"], ConfigError, "rollout.agent=tools needs agent.environment: the name of a registered "
                                          "environment (registered: calculator, python, verl_tools)"),
    (["agent.max_turnz=2"], ConfigError, "unknown config key 'agent.max_turnz' (did you mean 'max_turns'?)"),
    (["agent.max_turns=0"], ConfigError, "config key 'agent.max_turns' = 0 is not allowed: use an integer >= 1"),
    (["agent.tool_timeout_s=soon"], ConfigError, "config key 'agent.tool_timeout_s' has an invalid value 'soon'"),
])
def test_a_bad_agent_section_is_refused_before_anything_starts(tmp_path, plugins, overrides, error, line):
    from rlcore.dry_run import command as dry_run
    from rlcore.run import Run

    for build in (lambda cfg: Run(cfg, plugins), lambda cfg: dry_run(cfg, plugins)):
        with pytest.raises(error) as refused:
            build(tool_run(tmp_path, *overrides))
        assert str(refused.value).startswith(line) and "\n" not in str(refused.value), str(refused.value)
        assert not (tmp_path / "run").exists()          # Run.setup, which starts the workers, was not reached


def test_the_tools_agent_needs_its_plugin(tmp_path):
    from rlcore.run import Run

    with pytest.raises(PluginError, match=r"no agent named 'tools' is registered \(registered: single_turn\)"):
        Run(load_config("quickstart", [f"run.dir={tmp_path / 'run'}", "rollout.agent=tools"]),
            load_plugins(["qwen3", "grpo", "vllm"]))


def test_the_run_records_the_bound_section_and_logs_the_agents_metrics(tmp_path, plugins):
    """As before the section left the core: run.json holds every agent key with its default."""
    from dataclasses import asdict

    from rlcore.run import Run

    run = Run(tool_run(tmp_path, "agent.max_turns=3"), plugins)
    assert run.cfg.agent == asdict(AgentConfig(environment="calculator", max_turns=3, max_tool_response_tokens=64))
    assert run.agent.metrics is agent_metrics
    single = Run(load_config("quickstart", [f"run.dir={tmp_path / 'single'}", "agent.max_turns=3"]), plugins)
    assert single.agent.metrics is None and single.cfg.agent == {"max_turns": 3}     # single_turn reads no section


def test_rlcore_run_with_an_unknown_environment_fails_in_one_line_before_any_engine(tmp_path):
    done = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=" + ",".join(PLUGINS),
                    "tool-calculator", "agent.environment=no_such_env", f"run.dir={tmp_path / 'run'}"],
                   timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "rlcore: error: no environment named 'no_such_env' is registered (registered: calculator, python, "
        "verl_tools). Install the plugin that provides it, or check --plugins."], done.stderr[-2000:]
    assert not (tmp_path / "run").exists()
