"""mypy over the core, the built-in plugins and every contrib distribution, at the level `[tool.mypy]` sets."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_mypy_config_covers_every_distribution():
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    contrib = sorted(p.parent for p in REPO.glob("contrib/*/*/pyproject.toml"))
    assert {str(d.relative_to(REPO)) for d in contrib} | {"core", "plugins"} == set(mypy["mypy_path"])
    folders = [REPO / "core", REPO / "plugins", *contrib]
    packages = {p.parent.name for d in folders for p in d.glob("rlcore*/__init__.py")}
    assert packages == set(mypy["packages"])


@pytest.mark.slow
def test_mypy_finds_no_errors():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, done.stdout + done.stderr
