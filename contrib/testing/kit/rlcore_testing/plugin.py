"""The kit's pytest plugin (entry point ``pytest11``): the markers rlcore's test suites select by, and the fixtures
they share across distributions. Nothing heavy is imported until a fixture is used."""
from __future__ import annotations

import os

import pytest

MARKERS = {
    "slow": "multi-second tests that start vLLM or train (select with -m slow, skip with -m 'not slow')",
    "e2e": "end-to-end training runs",
    "parallel": "multi-process layouts (Ray workers on gloo)",
    "on_request": "runs kept out of the default selection for the suite's time, each beside a comment naming what "
                  "covers its parts in every run; RLCORE_ALL_LAYOUTS=1 selects them",
}
ALL = "RLCORE_ALL_LAYOUTS"


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the on-request tests unless RLCORE_ALL_LAYOUTS=1: they are not part of the default run (pytest
    counts them as deselected), rather than collected and skipped."""
    if os.environ.get(ALL) == "1":
        return
    kept = [item for item in items if item.get_closest_marker("on_request") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("on_request")])
        items[:] = kept


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE tokenizer trained here, with Qwen3's special tokens and a Qwen3-style chat template."""
    from rlcore_testing.gsm8k import chat_tokenizer

    return chat_tokenizer()
