"""The tool-calculator preset's warm start, built once per test run as the core's tests build the quickstart's; the
repository's run helpers (tests/runs.py: start, watch and kill `rlcore run`) shared with the core's tests."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from runs import build_warm_start_cache  # noqa: E402


@pytest.fixture(scope="session")
def tool_warm_start_cache(tmp_path_factory):
    """This test process's warm-start cache holding the tool-calculator preset's starting checkpoint (its own
    settings, so a cache entry of its own: its task, tokenizer, context and warm start)."""
    return build_warm_start_cache(tmp_path_factory, "tool-calculator", ["qwen3", "grpo", "vllm", "tools"])
