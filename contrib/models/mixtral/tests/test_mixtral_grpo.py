"""A few GRPO steps with a tiny Mixtral through `rlcore run --plugins=mixtral,grpo,vllm` (only this model plugin
loaded), vLLM's CPU engine checked against the actor after every weight push."""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_grpo_steps_with_engine_checks(tmp_path):
    history = run_grpo_smoke("mixtral,grpo,vllm", "mixtral", str(tmp_path / "run"), run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
