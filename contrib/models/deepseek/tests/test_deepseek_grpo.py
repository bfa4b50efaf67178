"""A few GRPO steps with tiny DeepSeek-V3 and Moonlight models through `rlcore run --plugins=deepseek,grpo,hf`.
vLLM's CPU build cannot run multi-latent attention correctly, so generation runs on transformers' implementation
(the rlcore-rollout-hf backend); the engine is checked against the Megatron actor after every weight push."""
import pytest

from rlcore.testing import run_grpo_smoke

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("family", ["deepseek_v3", "moonlight"])
def test_grpo_steps_with_engine_checks(tmp_path, family):
    # the entropy bonus moves the weights every step even when a tiny model's rewards are all equal (no advantage),
    # so each engine check sees freshly pushed weights
    history = run_grpo_smoke("deepseek,grpo,hf", family, str(tmp_path / "run"), 3, "rollout.backend=hf",
                             "actor.entropy_coef=0.01")
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    assert all(h["actor/grad_norm"] > 0 for h in history)
