"""A few GRPO steps with a tiny Qwen3-MoE through `rlcore run --plugins=qwen3,grpo,vllm` (the dense model runs in
the quickstart tests), vLLM's CPU engine checked against the actor after every weight push."""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_moe_grpo_steps_with_engine_checks(tmp_path):
    history = run_grpo_smoke("qwen3,grpo,vllm", "qwen3_moe", str(tmp_path / "run"), run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
