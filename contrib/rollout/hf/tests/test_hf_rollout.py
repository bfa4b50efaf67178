"""The transformers rollout backend against the Megatron actor: after every weight push its logprobs equal the
actor's (run_grpo_smoke checks it each step), its sampled logprobs are the actor's, and bad settings are named."""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_grpo_steps_on_transformers_match_the_actor(tmp_path):
    history = run_grpo_smoke("qwen3,grpo,hf", "qwen3", str(tmp_path / "run"), 3, "rollout.backend=hf", run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    # the engine's logprobs of the tokens it sampled equal the actor's recomputation (old policy = sampler)
    assert max(h["rollout/logprob_diff_vs_actor"] for h in history) < 1e-4


def test_rollout_tp_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from rlcore.errors import RlcoreError
    from rlcore_rollout_hf import HFRollout

    with pytest.raises(RlcoreError, match="rollout.tp=1"):
        HFRollout(str(tmp_path), SimpleNamespace(tp=2))
