"""The project's 120-column rule for Python source, kept by a test so that it cannot drift."""
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_COLUMNS = 120


def test_no_tracked_python_line_is_longer_than_120_columns():
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"git is not available: {e}")
    if listed.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: {listed.stderr.strip()}")
    files = [f for f in listed.stdout.split("\0") if f and (REPO / f).is_file()]
    assert files
    too_long = [f"{f}:{number}: {len(line)} columns"
                for f in files
                for number, line in enumerate((REPO / f).read_text(encoding="utf-8").split("\n"), 1)
                if len(line) > MAX_COLUMNS]
    assert not too_long, f"lines longer than {MAX_COLUMNS} columns:\n" + "\n".join(too_long)
