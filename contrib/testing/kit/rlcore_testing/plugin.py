"""The kit's pytest plugin (entry point ``pytest11``): the markers rlcore's test suites select by, and the fixtures
they share across distributions. Nothing heavy is imported until a fixture is used."""
from __future__ import annotations

import pytest

MARKERS = {
    "slow": "multi-second tests that start vLLM or train (select with -m slow, skip with -m 'not slow')",
    "e2e": "end-to-end training runs",
    "parallel": "multi-process layouts (Ray workers on gloo)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE tokenizer trained here, with Qwen3's special tokens and a Qwen3-style chat template."""
    from rlcore_testing.gsm8k import chat_tokenizer

    return chat_tokenizer()
