"""End to end, trainer.mode=async (real megatron-core trainer in the driver, a real vLLM engine in a Ray rollout
worker of its own, weights pushed after every update): with max_staleness 0 it is the colocated run step by step;
with 1 (2) its batches are one (two) versions behind, never more, and the engine agrees with the trainer after
pushes."""
import json
import os

import pytest

from runs import logged, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 4


def quickstart(run_dir, cache, *extra):
    import sys

    return [sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
            f"trainer.steps={STEPS}", "trainer.eval_every=2", "run.progress=false", "trainer.export_hf=false",
            f"run.dir={run_dir}", f"warm_start.cache_dir={cache}", *extra]


def comparable(history):
    """A step's metrics less timings and what only one mode reports: when a push is logged (the colocated run logs
    it at the step whose rollout it precedes, the async one after the update that made it), the queue's own, the
    rollout workers' roster."""
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "sync/", "async/", *ROSTER))} for h in history]


ROSTER = ("rollout/workers_", "rollout/restarts", "rollout/requests_reissued")


def test_staleness_zero_is_the_colocated_run_step_by_step(tmp_path, warm_start_cache):
    run_to_end(quickstart(tmp_path / "colocated", warm_start_cache))
    run_to_end(quickstart(tmp_path / "async", warm_start_cache, "trainer.mode=async", "rollout.max_staleness=0"))
    colocated, asynchronous = logged(tmp_path / "colocated"), logged(tmp_path / "async")
    assert len(asynchronous) == STEPS
    assert comparable(asynchronous) == comparable(colocated)
    assert all(h["async/staleness_max"] == 0 for h in asynchronous)
    summaries = [json.load(open(os.path.join(tmp_path / d, "summary.json"))) for d in ("colocated", "async")]
    assert summaries[0]["eval_accuracy_after"] == summaries[1]["eval_accuracy_after"]


@pytest.mark.parametrize("staleness", [1, 2])
def test_batches_train_s_versions_behind_never_more_and_the_engine_agrees(tmp_path, warm_start_cache, staleness):
    """At the start S + 1 draws are admitted with the starting weights, so step k trains min(k - 1, S) behind."""
    run_to_end(quickstart(tmp_path / "run", warm_start_cache, "trainer.mode=async",
                          f"rollout.max_staleness={staleness}", "rollout.partial=true",
                          "trainer.check_logprobs_every=1"))
    history = logged(tmp_path / "run")
    assert [h["async/staleness_max"] for h in history] == [float(min(k, staleness)) for k in range(STEPS)]
    assert all(h["check/logprob_max_diff"] < 1e-3 for h in history)    # after every push
    assert all(h["sync/bytes"] > 0 for h in history)
    assert all(0 <= h["async/trainer_idle_frac"] <= 1 for h in history[1:])


def test_sync_every_two_pushes_after_every_other_step_and_stays_within_the_bound(tmp_path, warm_start_cache):
    run_to_end(quickstart(tmp_path / "run", warm_start_cache, "trainer.mode=async", "rollout.max_staleness=1",
                          "rollout.sync_every=2"))
    history = logged(tmp_path / "run")
    assert ["sync/bytes" in h for h in history] == [False, True, False, True]
    assert all(h["async/staleness_max"] <= 1 for h in history)
