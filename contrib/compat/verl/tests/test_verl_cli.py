"""How `--verl` and `rlcore verl` reach the core's command line: through the core's rlcore_run_dialects and
rlcore_commands hooks, with the plugins loaded before the parser is built. Naming the flag or the command selects the
verl plugin even when --plugins leaves it out; without rlcore-verl installed, either stops in one line (exit 2)."""
from pathlib import Path

import pytest

from rlcore import plugins
from rlcore.cli import main
from rlcore.cli_plugins import plugins_for

EXAMPLE = str(Path(__file__).resolve().parent / "data" / "verl" / "run_qwen2-7b_math_megatron.sh")


def test_the_verl_plugin_registers_the_command_and_the_run_flag():
    registry = plugins.load_plugins(["verl"]).registry
    assert list(registry.commands) == ["verl"] and list(registry.run_dialects) == ["verl"]
    assert registry.owners[("run_dialects", "verl")].startswith("verl (rlcore-verl ")


def test_plugins_load_before_parsing_only_for_what_a_plugin_adds():
    for argv in (["run", "--help-config"], ["run", "--dry-run", "quickstart"], ["plugins", "--json"],
                 ["export", "ckpt", "out"]):
        assert plugins_for(argv) is None, argv
    assert plugins_for(["run", "--plugins=qwen3,grpo,vllm", "--verl"]).selection == ["qwen3", "grpo", "vllm", "verl"]
    assert plugins_for(["verl", "translate", "--plugins", "qwen2", "x.sh"]).selection == ["qwen2", "verl"]
    assert plugins_for(["run", "--verl"]).selection is None        # every installed plugin, verl among them


def test_verl_flag_selects_its_plugin_when_plugins_leave_it_out(capsys):
    assert main(["run", "--plugins=deepseek,grpo,vllm", "--verl", "--dry-run", "deepseek-v3-671b-96gpu",
                 "data.train_batch_size=96", "actor_rollout_ref.rollout.n=4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verl keys: 3 (3 translated, 0 with no effect in rlcore)\n"), out
    assert "trainer.prompts_per_step=96" in out and "world 96 = tp 8 x pp 12" in out


def test_verl_command_selects_its_plugin_when_plugins_leave_it_out(capsys):
    assert main(["verl", "translate", "--plugins=qwen2", EXAMPLE]) == 0
    assert capsys.readouterr().out.startswith("# from run_qwen2-7b_math_megatron.sh (verl --config-name=")


@pytest.mark.parametrize("argv, what", [
    (["run", "--verl", "--dry-run", "data.train_batch_size=16"], "--verl"),
    (["run", "--plugins=qwen3,grpo,vllm", "--verl", "data.train_batch_size=16"], "--verl"),
    (["verl", "translate", EXAMPLE], "`rlcore verl`"),
])
def test_without_rlcore_verl_installed_the_flag_and_command_say_what_to_install(argv, what, monkeypatch, capsys):
    installed = plugins.installed_entry_points()
    monkeypatch.setattr(plugins, "installed_entry_points",
                        lambda: {name: ep for name, ep in installed.items() if name != "verl"})
    assert main(argv) == 2
    err = capsys.readouterr().err       # Ray may still echo an earlier test's worker logs first: the last line is ours
    assert err.endswith("\n") and err.splitlines()[-1] == (f"rlcore: error: {what} needs the rlcore-verl distribution, "
                                                          "which is not installed: pip install rlcore-verl")
