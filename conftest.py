"""What every test suite of the repository shares (tests/ and the contrib distributions' tests/): the run helpers
in tests/runs.py, and the quickstart's warm start, built once for the whole test run, so that no suite trains it
again (~1-2 min of CPU each time)."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")       # before runs.py notes the environment its runs start from
sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from runs import build_warm_start_cache  # noqa: E402


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """This test process's warm-start cache, holding the quickstart's starting checkpoint from the start, built once
    for the whole test run (``runs.build_warm_start_cache``)."""
    return build_warm_start_cache(tmp_path_factory, "quickstart", ["qwen3", "grpo", "vllm"])
