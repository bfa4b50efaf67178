"""End to end, trainer.mode=async with actor.mini_batches=2 (two optimizer updates a step, so two weight versions):
rollout.max_staleness=1 holds in versions, the unit the engines report with every sample (Trajectory.version). One
step of staleness would be two versions, past the bound, so every batch is sampled by the weights that start its
step. The trained rows' versions are read off the batches themselves (a plugin's rlcore_rollout_end)."""
import json
import os

import pytest

from runs import ENV, async_quickstart, install_distribution, logged, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS, BATCH, MINI_BATCHES = 6, 16, 2       # BATCH: the quickstart's trainer.prompts_per_step
RECORDER = '''"""Writes each step's trained rows' weight versions (the oldest that sampled each row) to one JSON
line."""
import json

from rlcore.hookspecs import hookimpl


@hookimpl
def rlcore_rollout_end(step, batch):
    with open({path!r}, "a") as f:
        f.write(json.dumps({{"step": step, "versions": batch["version"].tolist()}}) + "\\n")
'''


def test_two_mini_batches_keep_the_staleness_bound_in_versions(tmp_path, warm_start_cache):
    site, record = tmp_path / "site", tmp_path / "versions.jsonl"
    site.mkdir()
    install_distribution(site, "rlcore-version-recorder", "version_recorder", RECORDER.format(path=str(record)),
                         entry="version_recorder")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    run_to_end(async_quickstart(run_dir, warm_start_cache, f"actor.mini_batches={MINI_BATCHES}",
                                "rollout.world_size=1", plugins="qwen3,grpo,vllm,version_recorder", steps=STEPS),
               env=env)
    history = logged(run_dir)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    # every step trains a full batch in two updates: the learner starts step k at version 2(k - 1)
    assert all(h["sampling/groups_kept"] == BATCH and "sampling/skipped_update" not in h for h in history)
    with open(record) as f:
        trained = [json.loads(line) for line in f]
    assert [t["step"] for t in trained] == list(range(1, STEPS + 1))
    behind = [max(MINI_BATCHES * (t["step"] - 1) - v for v in t["versions"]) for t in trained]
    assert all(0 <= b <= 1 for b in behind), behind        # rollout.max_staleness=1, in versions
    assert behind == [0] * STEPS                           # one step behind would be two
    assert [h["async/staleness_max"] for h in history] == [0.0] * STEPS     # the metric in the same unit
