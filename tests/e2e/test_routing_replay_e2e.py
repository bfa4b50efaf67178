"""Routing replay end to end (``actor.moe.routing_replay=rollout``): `rlcore run` on a tiny Qwen3-MoE whose rollout
engine (transformers, rlcore-rollout-hf) returns the experts it routed every token to, in async mode, where batches
meet newer weights than sampled them.

- Stale batches: the learner routed live sends a share of their tokens to other experts than the engine did
  (``routing/token_differs_frac``); the update replays the engine's, and its logprob mismatch to the engine
  (``rollout_corr/kl_k3``) is below the live pass's (``routing/live_kl_k3``).
- Colocated at PP2: the engine's routes reach the learner's routers at the tokens they belong to (on-policy, the
  learner routed live chooses what the engine chose, token for token; a misplaced route would differ at about every
  token). The same is asserted at TP1 and at TP2 with SP and LoRA for DeepSeek-V3 and Moonlight on the transformers
  engine (contrib/models/deepseek/tests/test_deepseek_grpo.py), and for Qwen2-MoE on SGLang's CPU engine
  (contrib/models/qwen2/tests/test_qwen2_grpo.py).
- Partial rollouts, LoRA, kill -9 and resume: requests aborted by weight pushes and resumed carry complete routes
  (``routing/rows_incomplete`` 0), in order: with no reward signal the weights never move, so the learner routed
  live must reproduce the engine's routes token for token, and a row misplaced by a resumption would differ.
"""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import EVERY, STEPS, kill_when, logged, rlcore_run, run_cli, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MOE_ON_HF = ("model.family=qwen3_moe", "rollout.backend=hf", "actor.moe.routing_replay=rollout", "trainer.mode=async",
             "rollout.max_staleness=1", "trainer.eval_every=0")


def replay_run(run_dir, *extra):
    return rlcore_run(run_dir, run_dir.parent / "warm_start", *MOE_ON_HF, *extra, plugins="qwen3,grpo,hf")


def test_stale_batches_route_differently_live_and_the_replayed_update_is_closer_to_the_engine(tmp_path):
    run_to_end(replay_run(tmp_path / "run", "warm_start.steps=20", "warm_start.target_accuracy=0",
                          "trainer.save_every=0"))
    history = logged(tmp_path / "run")
    assert len(history) == STEPS and all(h["routing/rows_incomplete"] == 0 for h in history)
    stale = [h for h in history if h["async/staleness_max"] == 1]
    assert len(stale) == STEPS - 1 and all(h["routing/token_differs_frac"] > 0 for h in stale)
    live = sum(h["routing/live_kl_k3"] for h in stale)
    replayed = sum(h["rollout_corr/kl_k3"] for h in stale)
    assert replayed < live, (replayed, live)


def test_resumed_requests_carry_complete_routes_in_order_across_kill_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    slow = ("warm_start.steps=0", "rollout.partial=true", "rollout.max_response_len=32", "trainer.prompts_per_step=8",
            "actor.lora.rank=4", "actor.lora.alpha=8")   # untrained: responses run to their budget, pushes abort them
    checkpoint = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    kill_when(replay_run(run_dir, *slow), lambda: len(logged(run_dir)) > EVERY and checkpoint.exists())
    run_to_end(rlcore_run(run_dir, None, "--resume", plugins="qwen3,grpo,hf"))
    history = logged(run_dir)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert sum(h["async/resumed_requests"] for h in history) > 0, "no request was resumed after a weight push"
    assert sum(h["async/resumed_requests"] for h in history[EVERY:]) > 0, "none after the resume either"
    assert all(h["actor/grad_norm"] == 0 for h in history), "the weights moved: routes could differ legitimately"
    assert all(h["routing/rows_incomplete"] == 0 for h in history)
    assert all(h["routing/token_differs_frac"] == 0 for h in history), [h["routing/token_differs_frac"]
                                                                      for h in history]


def test_the_engines_routes_reach_the_learners_tokens_at_pp2(tmp_path):
    history = run_grpo_smoke("qwen3,grpo,hf", "qwen3_moe", str(tmp_path / "run"), 2, "rollout.backend=hf",
                             "actor.moe.routing_replay=rollout", "actor.entropy_coef=0.01", "trainer.world_size=2",
                             "actor.parallel.pp=2", "warm_start.steps=0", "trainer.prompts_per_step=8", run=run_cli)
    assert all(h["routing/rows_incomplete"] == 0 for h in history)
    assert all(h["routing/token_differs_frac"] == 0 for h in history), [h["routing/token_differs_frac"]
                                                                      for h in history]
