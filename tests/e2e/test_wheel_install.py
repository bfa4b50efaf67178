"""Installed the way users install: every distribution's built wheel, non-editable, in a fresh virtual environment.

Editable installs map import names to folders and hide packaging gaps (a subpackage missing from the wheel). This
test builds the wheel of `rlcore` and of every contrib distribution, installs them into a new venv that sees the
already-installed heavy dependencies (torch, vLLM, megatron-core, Ray) through a path entry, and runs the CLI from
there. The path entry does not run the parent's `.pth` files, so the editable checkout is not importable from it.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [REPO] + sorted(p.parent for p in REPO.glob("contrib/*/*/pyproject.toml"))

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _run(cmd, **kw):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """A fresh venv holding only the wheels of rlcore and its contrib distributions; heavy dependencies shared."""
    root = tmp_path_factory.mktemp("wheels")
    # Built from a copy without the checkout's build leftovers (a stale build/lib would ship deleted modules).
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                  "runs", ".*_cache"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist,
          *(source / d.relative_to(REPO) for d in DISTRIBUTIONS)], cwd=root)
    wheels = sorted(dist.glob("*.whl"))
    assert len(wheels) == len(DISTRIBUTIONS), [w.name for w in wheels]

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "shared_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", *wheels],
         cwd=root)
    return venv


def _env(venv):
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return env


def test_every_package_imports_from_the_wheels(wheel_venv, tmp_path):
    """Each distribution's packages resolve inside the venv, not the checkout (a missing subpackage fails here)."""
    modules = ["rlcore", "rlcore_plugins"] + [p.name for d in DISTRIBUTIONS[1:] for p in d.glob("rlcore_*")
                                               if (p / "__init__.py").exists()]
    script = ("import importlib, pkgutil\n"
              f"for top in {modules!r}:\n"
              "    pkg = importlib.import_module(top)\n"
              "    print(pkg.__file__)\n"
              "    for info in pkgutil.walk_packages(pkg.__path__, top + '.'):\n"
              "        print(importlib.import_module(info.name).__file__)\n")
    files = _run([wheel_venv / "bin" / "python", "-c", script], cwd=tmp_path, env=_env(wheel_venv)).split()
    assert files and all(Path(f).is_relative_to(wheel_venv) for f in files), \
        [f for f in files if not Path(f).is_relative_to(wheel_venv)]
    # Every module of the checkout is in the wheels: its path from the import folder (named as imported) down.
    installed = {Path(f).relative_to(_site(wheel_venv)).with_suffix("").as_posix() for f in files}
    assert _checkout_modules() <= installed, sorted(_checkout_modules() - installed)


def _checkout_modules():
    modules = set()
    for dist in DISTRIBUTIONS:
        for path in dist.rglob("*.py"):
            parts = path.relative_to(dist).with_suffix("").parts
            top = next((i for i, part in enumerate(parts) if part.startswith("rlcore")), None)
            if top is not None and "tests" not in parts:
                modules.add("/".join(parts[top:]))
    return modules


def _site(venv):
    return next((venv / "lib").glob("python*/site-packages"))


def test_plugins_listed_as_in_the_checkout(wheel_venv, tmp_path):
    from_wheels = _run([wheel_venv / "bin" / "rlcore", "plugins"], cwd=tmp_path, env=_env(wheel_venv))
    from_checkout = _run([Path(sys.executable).parent / "rlcore", "plugins"], cwd=tmp_path)
    assert "qwen3" in from_wheels and from_wheels == from_checkout


def test_the_wheel_carries_configs_as_the_presets(wheel_venv):
    """configs/ (the recipes, kept once in the checkout) is installed whole as rlcore.presets, byte for byte."""
    configs = REPO / "configs"
    recipes = {p.relative_to(configs).as_posix(): p.read_bytes() for p in configs.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    installed = _site(wheel_venv) / "rlcore" / "presets"
    assert {name: (installed / name).read_bytes() if (installed / name).is_file() else None
            for name in recipes} == recipes


def test_a_large_preset_dry_runs_from_the_wheels(wheel_venv, tmp_path):
    report = _run([wheel_venv / "bin" / "rlcore", "run", "--plugins=deepseek,grpo,vllm", "--dry-run",
                   "deepseek-v3-671b-96gpu"], cwd=tmp_path, env=_env(wheel_venv))
    assert "671.0B parameters" in report and "tp 8 x pp 12" in report, report


def test_quickstart_runs_from_the_wheels(wheel_venv, tmp_path, warm_start_cache):
    run_dir = tmp_path / "run"
    _run([wheel_venv / "bin" / "rlcore", "run", "--plugins=qwen3,grpo,vllm", "quickstart", "trainer.steps=2",
          "trainer.eval_every=0", "run.progress=false", f"run.dir={run_dir}",
          f"warm_start.cache_dir={warm_start_cache}"], cwd=tmp_path, env=_env(wheel_venv))
    steps = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2 and (run_dir / "summary.json").exists()


def test_diagnose_reads_the_lock_from_the_wheel(wheel_venv, tmp_path):
    """The wheel carries the lock (rlcore/constraints.txt, a link in the checkout): diagnose finds the stack as
    tested from a wheel install too."""
    installed = _site(wheel_venv) / "rlcore" / "constraints.txt"
    assert not installed.is_symlink() and installed.read_text() == (REPO / "scripts" / "constraints.txt").read_text()
    report = _run([wheel_venv / "bin" / "rlcore", "diagnose"], cwd=tmp_path, env=_env(wheel_venv))
    assert report.rstrip().endswith("no problems: the stack is as tested"), report
