"""A few GRPO steps with tiny DeepSeek-V3 and Moonlight models through `rlcore run --plugins=deepseek,grpo,hf` (and
DeepSeek-V3 with LoRA on its attention at TP2).
vLLM's CPU build cannot run multi-latent attention correctly, so generation runs on transformers' implementation
(the rlcore-rollout-hf backend); the engine is checked against the Megatron actor after every weight push. Every
run replays the engine's routed experts (actor.moe.routing_replay=rollout): on-policy in fp32 the learner routed live
chooses what the engine chose for every token (DeepSeek-V3's first layer dense, group-limited sigmoid routing with a
score bias), so the routes reached the learner's tokens whole and in order, at TP1 and at TP2 with SP and LoRA."""
REPLAY = "actor.moe.routing_replay=rollout"


def assert_routes_reached_the_learner(history) -> None:
    assert all(h["routing/rows_incomplete"] == 0 and h["routing/token_differs_frac"] == 0 for h in history), \
        [(h["routing/rows_incomplete"], h["routing/token_differs_frac"]) for h in history]
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("family", ["deepseek_v3", "moonlight"])
def test_grpo_steps_with_engine_checks(tmp_path, family):
    # the entropy bonus moves the weights every step even when a tiny model's rewards are all equal (no advantage),
    # so each engine check sees freshly pushed weights
    history = run_grpo_smoke("deepseek,grpo,hf", family, str(tmp_path / "run"), 3, "rollout.backend=hf",
                             "actor.entropy_coef=0.01", REPLAY, run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    assert all(h["actor/grad_norm"] > 0 for h in history)
    assert_routes_reached_the_learner(history)


def test_grpo_steps_with_adapters_on_mla_at_tp2(tmp_path):
    """LoRA on DeepSeek-V3's multi-latent attention projections, TP2 with sequence parallelism: the merged weights
    pushed after every step give the engine the actor's logprobs (run_grpo_smoke checks it)."""
    mla = "[linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,linear_proj]"
    history = run_grpo_smoke("deepseek,grpo,hf", "deepseek_v3", str(tmp_path / "run"), 3, "rollout.backend=hf",
                             "actor.entropy_coef=0.01", "trainer.world_size=2", "actor.parallel.tp=2",
                             "actor.parallel.sp=true", "actor.lora.rank=4", "actor.lora.alpha=8",
                             f"actor.lora.target_modules={mla}", REPLAY, run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    assert all(h["actor/grad_norm"] > 0 for h in history)
    assert_routes_reached_the_learner(history)
