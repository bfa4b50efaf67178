"""Plugin discovery and selection through real entry points (distributions installed into a temp site dir)."""
import sys

import pytest

from rlcore.errors import PluginError
from rlcore.plugins import load_plugins, parse_selection


def _install_fake_distribution(root, dist, module, body, entry="fake"):
    """A real distribution on sys.path: <dist>.dist-info with METADATA + entry_points.txt, and its module."""
    info = root / f"{dist.replace('-', '_')}-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text(f"[rlcore]\n{entry} = {module}\n")
    (root / f"{module}.py").write_text(body)


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
    _install_fake_distribution(site, "rlcore-model-impostor", "fake_rlcore_impostor",
                               "from rlcore.hookspecs import hookimpl\n"
                               "from rlcore_model_qwen3.plugin import QWEN3\n"
                               "@hookimpl\ndef rlcore_models():\n    return [QWEN3]\n", entry="impostor")
    with pytest.raises(PluginError) as e:
        load_plugins(["qwen3", "impostor"])
    msg = str(e.value)
    assert "model 'qwen3'" in msg and "rlcore-model-qwen3" in msg and "rlcore-model-impostor 9.9" in msg


def test_plugin_that_fails_to_import_is_reported_with_its_distribution(site):
    _install_fake_distribution(site, "rlcore-broken", "fake_rlcore_broken", "import no_such_module_xyz\n",
                               entry="broken")
    with pytest.raises(PluginError) as e:
        load_plugins(["broken"])
    msg = str(e.value)
    assert "rlcore-broken 9.9" in msg and "no_such_module_xyz" in msg and "ModuleNotFoundError" in msg
