"""kill -9 during an async run (max_staleness 1), resume: the run continues to its last step and no batch, before
or after the resume, trains more than one version behind (the staleness accounting rebased on the restored version,
AReaL #1388)."""
import pytest

from runs import EVERY, STEPS, kill_when, logged, rlcore_run, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_kill_and_resume_keeps_the_staleness_bound(tmp_path, warm_start_cache):
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    kill_when(rlcore_run(run_dir, warm_start_cache, "trainer.mode=async", "rollout.max_staleness=1"),
              lambda: len(logged(run_dir)) > EVERY and checkpoint.exists())
    run_to_end(rlcore_run(run_dir, warm_start_cache, "--resume"))
    history = logged(run_dir)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert all(h["async/staleness_max"] <= 1 for h in history), [h["async/staleness_max"] for h in history]
    assert history[EVERY]["async/staleness_max"] == 0       # the first step after the resume: rebased, fresh
    assert history[-1]["async/staleness_max"] == 1
