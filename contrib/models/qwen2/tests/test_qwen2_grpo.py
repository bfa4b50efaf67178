"""Three GRPO steps with a tiny Qwen2 (QKV bias) and a tiny Qwen2-MoE (shared expert behind its sigmoid gate) through
`rlcore run --plugins=qwen2,grpo,<engine>` on vLLM and on SGLang: the engine is checked against the actor after every
weight push (run_grpo_smoke: max logprob difference < 1e-3). SGLang's Qwen2-MoE on CPU takes its shared-expert gate
from rlcore_rollout_sglang's shim (shared_expert_gate_in_torch). On SGLang the Qwen2-MoE run replays the engine's
routed experts (actor.moe.routing_replay=rollout): on-policy in fp32 the learner routed live chooses what the engine
chose for every token, so the routes reached the learner's tokens whole and in order."""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("family, engine", [("qwen2", "vllm"), ("qwen2", "sglang"),
                                            ("qwen2_moe", "vllm"), ("qwen2_moe", "sglang")])
def test_grpo_steps_with_engine_checks(family, engine, tmp_path):
    replay = ["actor.moe.routing_replay=rollout"] if (family, engine) == ("qwen2_moe", "sglang") else []
    history = run_grpo_smoke(f"qwen2,grpo,{engine}", family, str(tmp_path / "run"), 3, f"rollout.backend={engine}",
                             *replay, run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    if replay:
        assert all(h["routing/rows_incomplete"] == 0 and h["routing/token_differs_frac"] == 0 for h in history), \
            [(h["routing/rows_incomplete"], h["routing/token_differs_frac"]) for h in history]
