"""Plugin discovery and selection through real entry points (distributions installed into a temp site dir)."""
import os
import sys

import pytest

from rlcore.errors import PluginError
from rlcore.plugins import load_plugins, parse_selection
from runs import install_distribution, run_cli


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_rlcore_")]:
        del sys.modules[name]


def test_installed_plugins_load_and_register():
    loaded = load_plugins(["qwen3", "grpo", "vllm"])
    assert {p.name for p in loaded.plugins} == {"builtin", "qwen3", "grpo", "vllm"}
    assert "qwen3" in loaded.registry.models and "grpo" in loaded.registry.algorithms
    described = {row["name"]: row for row in loaded.describe()}
    assert described["qwen3"]["distribution"] == "rlcore-model-qwen3"
    assert described["qwen3"]["registers"] == {"models": ["qwen3", "qwen3_moe"]}


def test_selection_loads_only_the_named_plugins():
    loaded = load_plugins(["grpo"])
    assert "qwen3" not in loaded.registry.models
    with pytest.raises(PluginError, match="no model named 'qwen3'.*Install the plugin"):
        loaded.registry.get("models", "qwen3")


def test_unknown_plugin_lists_what_is_installed():
    with pytest.raises(PluginError) as e:
        load_plugins(["qwen3", "nosuch"])
    assert "'nosuch'" in str(e.value) and "qwen3 (rlcore-model-qwen3)" in str(e.value)


def test_empty_selection_is_refused():
    with pytest.raises(PluginError, match="--plugins is empty"):
        parse_selection(" , ")


def test_duplicate_names_name_both_plugins(site):
    install_distribution(site, "rlcore-model-impostor", "fake_rlcore_impostor",
                         "from rlcore.hookspecs import hookimpl\n"
                         "from rlcore_model_qwen3.plugin import QWEN3\n"
                         "@hookimpl\ndef rlcore_models():\n    return [QWEN3]\n", entry="impostor")
    with pytest.raises(PluginError) as e:
        load_plugins(["qwen3", "impostor"])
    msg = str(e.value)
    assert "model 'qwen3'" in msg and "rlcore-model-qwen3" in msg and "rlcore-model-impostor 9.9" in msg


def test_plugin_that_fails_to_import_is_reported_with_its_distribution(site):
    install_distribution(site, "rlcore-broken", "fake_rlcore_broken", "import no_such_module_xyz\n",
                         entry="broken")
    with pytest.raises(PluginError) as e:
        load_plugins(["broken"])
    msg = str(e.value)
    assert "rlcore-broken 9.9" in msg and "no_such_module_xyz" in msg and "ModuleNotFoundError" in msg


WIDGET_SPECS = 'from rlcore.hookspecs import hookspec\n@hookspec\ndef rlcore_widgets():\n    """Widgets."""\n'
WIDGETS = ("import fake_rlcore_widget_specs\nfrom rlcore.hookspecs import hookimpl\n"
           "class Widget:\n    name = 'w1'\n"
           "@hookimpl\ndef rlcore_add_hookspecs(pluginmanager):\n"
           "    pluginmanager.add_hookspecs(fake_rlcore_widget_specs)\n    return {'widgets': 'rlcore_widgets'}\n"
           "@hookimpl\ndef rlcore_widgets():\n    return [Widget()]\n")
WIDGET_USER = ("from rlcore.hookspecs import hookimpl\nclass Widget:\n    name = 'w2'\n"
               "@hookimpl\ndef rlcore_widgets():\n    return [Widget()]\n")


def test_a_plugin_brings_its_own_hookspecs_and_registry_kind(site):
    """As pytest plugins add theirs: the hooks and the registry kind come with the plugin that declares them, for
    plugins registered before it too ('auser' loads before 'widgets'), and not without it."""
    (site / "fake_rlcore_widget_specs.py").write_text(WIDGET_SPECS)
    install_distribution(site, "rlcore-widgets", "fake_rlcore_widgets", WIDGETS, entry="widgets")
    install_distribution(site, "rlcore-widget-user", "fake_rlcore_widget_user", WIDGET_USER, entry="auser")
    loaded = load_plugins(["auser", "widgets"])
    assert sorted(loaded.registry.table("widgets")) == ["w1", "w2"]
    assert {row["name"]: row["registers"] for row in loaded.describe()}["auser"] == {"widgets": ["w2"]}
    assert load_plugins(["grpo"]).registry.table("widgets") == {}
    with pytest.raises(PluginError, match="plugin auser .*: hookimpl 'rlcore_widgets' matches no rlcore hook"):
        load_plugins(["auser"])


TYPO_PLUGIN = ("from rlcore.hookspecs import hookimpl\n"
               "@hookimpl\ndef rlcore_register_modls():\n    return []\n"
               "@hookimpl(optionalhook=True)\ndef rlcore_some_future_hook():\n    pass\n")
TYPO_LINE = ("plugin typo (rlcore-typo 9.9): hookimpl 'rlcore_register_modls' matches no rlcore hook "
             "(did you mean 'rlcore_models'?). Rename it in fake_rlcore_typo")


def test_misspelled_hookimpl_fails_loading_naming_plugin_and_name(site):
    install_distribution(site, "rlcore-typo", "fake_rlcore_typo", TYPO_PLUGIN, entry="typo")
    with pytest.raises(PluginError) as e:
        load_plugins(["grpo", "typo"])
    assert str(e.value) == TYPO_LINE          # the optional hook is not named: pluggy lets it wait for its spec


def test_optional_hookimpl_without_a_spec_loads(site):
    install_distribution(site, "rlcore-later", "fake_rlcore_later",
                         "from rlcore.hookspecs import hookimpl\n"
                         "@hookimpl(optionalhook=True)\ndef rlcore_some_future_hook():\n    pass\n", entry="later")
    assert "later" in {p.name for p in load_plugins(["grpo", "later"]).plugins}


@pytest.mark.parametrize("command", [["plugins", "--plugins=grpo,typo"],
                                     ["run", "--plugins=qwen3,grpo,vllm,typo", "--dry-run"]])
def test_misspelled_hookimpl_through_the_cli_is_one_line(site, command):
    install_distribution(site, "rlcore-typo", "fake_rlcore_typo", TYPO_PLUGIN, entry="typo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = run_cli([sys.executable, "-m", "rlcore.cli", *command], env, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"rlcore: error: {TYPO_LINE}"], result.stderr[-2000:]
