"""The tool-calculator preset's warm start, built once per test run as the repository's conftest.py builds the
quickstart's, with its run helpers (tests/runs.py: start, watch and kill `rlcore run`)."""
import pytest

from runs import build_warm_start_cache


@pytest.fixture(scope="session")
def tool_warm_start_cache(tmp_path_factory):
    """This test process's warm-start cache holding the tool-calculator preset's starting checkpoint (its own
    settings, so a cache entry of its own: its task, tokenizer, context and warm start)."""
    return build_warm_start_cache(tmp_path_factory, "tool-calculator", ["qwen3", "grpo", "vllm", "tools"])
