"""Runs whose reward is a reward model's score, as a user launches them: the reward model on workers of its own in
another layout than the actor's (TP2 beside a TP1 actor, colocated; killed with SIGKILL after a checkpoint and
resumed, the run logs exactly what the uninterrupted one did), and in async mode; the task's own reward logged beside
it (weight 0), in training and held-out metrics."""
import math

import pytest

from reward_models import classifier_from
from runs import EVERY, STEPS, async_quickstart, kill_when, logged, rlcore_run, run_to_end, without_timings

PLUGINS = "qwen3,grpo,vllm"


@pytest.fixture(scope="module")
def reward_model(quickstart_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_model") / "rm"
    classifier_from(quickstart_model, path, pad_token_id=0)
    return path


def assert_scored_by_the_reward_model(history, steps):
    assert len(history) == steps
    for h in history:
        assert math.isfinite(h["reward/rm/mean"]) and "reward/exact_match/mean" in h
        assert h["reward/failed"] == 0
    # the reward trained on is the reward model's alone (exact match is logged at weight 0)
    assert any(abs(h["reward/mean"] - h["reward/rm/mean"]) < 1e-6 for h in history)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_with_a_tp2_reward_model_killed_and_resumed_logs_what_the_uninterrupted_run_logged(
        reward_model, warm_start_cache, tmp_path):
    overrides = [f"reward_model.path={reward_model}", "reward_model.world_size=2", "reward_model.parallel.tp=2",
                 "trainer.export_hf=false"]
    uninterrupted = tmp_path / "uninterrupted"
    out = run_to_end(rlcore_run(uninterrupted, warm_start_cache, *overrides, plugins=PLUGINS))
    assert "held-out exact_match: before RL" in out.stdout
    history = logged(uninterrupted)
    assert_scored_by_the_reward_model(history, STEPS)
    assert math.isfinite(history[-1]["eval/reward/rm/mean"]) and 0 <= history[-1]["eval/reward/exact_match/mean"] <= 1
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    kill_when(rlcore_run(run_dir, warm_start_cache, *overrides, plugins=PLUGINS),
              lambda: len(logged(run_dir)) >= EVERY + 2 and first.exists())
    run_to_end(rlcore_run(run_dir, warm_start_cache, "--resume", plugins=PLUGINS))
    assert without_timings(logged(run_dir)) == without_timings(history)


@pytest.mark.slow
@pytest.mark.e2e
def test_an_async_run_trains_its_reward_model_first_and_caches_it(warm_start_cache, tmp_path):
    """reward_model.path empty and reward_training's pairs given (rlhf-quickstart's way, at a tiny size): the run
    trains the reward model first, caches it beside the warm start, and an identical run finds it there."""
    pairs = ["reward_training.synthetic_pairs=64", "reward_training.val_pairs=16", "reward_training.pairs_per_step=16",
             "reward_model.micro_batch_size=32"]
    first = run_to_end(async_quickstart(tmp_path / "first", warm_start_cache, *pairs, steps=3))
    assert "no cached reward model: training one on 64 preference pairs" in first.stderr
    assert_scored_by_the_reward_model(logged(tmp_path / "first"), 3)
    [cached] = list(warm_start_cache.glob("reward-model-addition-*"))
    assert (cached / "rlcore_ready.json").is_file() and (cached / "config.json").is_file()
    again = run_to_end(async_quickstart(tmp_path / "again", warm_start_cache, *pairs, steps=1))
    assert f"using cached reward model {cached}" in again.stderr
