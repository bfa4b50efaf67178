"""Runs whose reward is a reward model's score, as a user launches them: the reward model on workers of its own in
another layout than the actor's (TP2 beside a TP1 actor, colocated), and in async mode; the task's own reward logged
beside it (weight 0), in training and held-out metrics."""
import math

from reward_models import classifier_from
from runs import async_quickstart, logged, rlcore_run, run_to_end


def assert_scored_by_the_reward_model(history, steps):
    assert len(history) == steps
    for h in history:
        assert math.isfinite(h["reward/rm/mean"]) and "reward/exact_match/mean" in h
        assert h["reward/failed"] == 0
    # the reward trained on is the reward model's alone (exact match is logged at weight 0)
    assert any(abs(h["reward/mean"] - h["reward/rm/mean"]) < 1e-6 for h in history)


def test_colocated_run_with_a_reward_model_at_tp2(quickstart_model, warm_start_cache, tmp_path):
    classifier_from(quickstart_model, tmp_path / "rm", pad_token_id=0)
    run_dir = tmp_path / "run"
    run_to_end(rlcore_run(run_dir, warm_start_cache, "trainer.steps=3", "trainer.save_every=0",
                          "trainer.eval_every=0", "trainer.export_hf=false", f"reward_model.path={tmp_path / 'rm'}",
                          "reward_model.world_size=2", "reward_model.parallel.tp=2", plugins="qwen3,grpo,vllm"))
    history = logged(run_dir)
    assert_scored_by_the_reward_model(history, 3)
    final = history[-1]
    assert math.isfinite(final["eval/reward/rm/mean"]) and 0 <= final["eval/reward/exact_match/mean"] <= 1


def test_async_run_with_a_reward_model(quickstart_model, warm_start_cache, tmp_path):
    classifier_from(quickstart_model, tmp_path / "rm", pad_token_id=0)
    run_dir = tmp_path / "run"
    run_to_end(async_quickstart(run_dir, warm_start_cache, f"reward_model.path={tmp_path / 'rm'}", steps=3))
    assert_scored_by_the_reward_model(logged(run_dir), 3)
