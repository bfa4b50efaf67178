"""Runs that heal themselves and stop when told (issue 42), as `rlcore run` processes: a Ray worker SIGKILLed mid-run
with trainer.max_restarts set restarts the run from its newest checkpoint, and the run logs what the uninterrupted
run logged, each step once; SIGTERM to the main process (as Kubernetes sends it to PID 1) stops a colocated and an
async run after a checkpoint of the step under way, exit status 143, nothing of the run left, and `--resume` logs
what the uninterrupted run logged. The logic under them, and the grace period's watchdog on a real process tree:
tests/unit/test_supervision.py."""
import json
import os
import random
import re
import signal
import time

import pytest

from rlcore.checkpoint import STATE
from runs import (EVERY, STEPS, async_quickstart, logged, ray_workers, rlcore_run, run_processes, run_to_end, shm_left,
                  shm_segments, start, wait_until, without_timings)
from test_async_failures import outliving

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.parallel]

LAYOUT = ["trainer.world_size=2"]       # data parallel over two Ray workers: one of them can die
GRACE_S = 60


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, warm_start_cache) -> tuple:
    """What the two-worker run logs without interruption, timings left out (run once for the module's tests, which
    only read it)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_to_end(rlcore_run(run_dir, warm_start_cache, *LAYOUT))
    history = logged(run_dir)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    return tuple(without_timings(history))


def test_a_killed_worker_restarts_the_run_which_logs_what_the_uninterrupted_run_logged(tmp_path, warm_start_cache,
                                                                                     uninterrupted):
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    with open(tmp_path / "stderr", "w") as stderr:
        run = start(rlcore_run(run_dir, warm_start_cache, *LAYOUT, "trainer.max_restarts=2"), stderr=stderr)

        def mid_run():     # step 5 logged, after the checkpoint of step 4
            if len(logged(run_dir)) > EVERY and checkpoint.exists():
                found = ray_workers(run.pid, "ActorRolloutWorker")
                return found if len(found) == 2 else None

        try:
            victim = wait_until(run, mid_run)[1]
            victim.kill()
            code = run.wait(timeout=900)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    assert code == 0, err[-4000:]
    restarted = [line for line in err.splitlines() if "restarting from" in line]
    assert len(restarted) == 1 and re.fullmatch(
        rf"rlcore: actor worker rank (\d) \(tp 0, pp 0, cp 0, ep 0, dp \1; pid {victim.pid} on \S+\) died during \w+: "
        rf"its process was killed \(Ray: SYSTEM_ERROR, .*\); restarting from its step {EVERY} checkpoint \(restart 1 "
        rf"of 2\)", restarted[0]), err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert without_timings(logged(run_dir)) == list(uninterrupted)        # each step once, as it was logged there
    [restart] = json.loads((run_dir / "summary.json").read_text())["restarts"]
    assert restart["from_step"] == EVERY and EVERY < restart["after_step"] < STEPS, restart
    assert restarted[0].startswith(f"rlcore: {restart['why']}; "), (restart, restarted[0])


def sigterm_when(tmp_path, cmd, condition):
    """Start ``cmd``, SIGTERM its main process (only) once ``condition()`` holds: the exit code, the seconds it took
    to exit, its stderr, its processes at the signal, and the /dev/shm segments it left."""
    shm_before = shm_segments()
    with open(tmp_path / "stderr", "w") as stderr:
        run = start(cmd, stderr=stderr)
        try:
            wait_until(run, lambda: condition(run))
            processes = run_processes(run.pid)
            os.kill(run.pid, signal.SIGTERM)
            sent = time.monotonic()
            code = run.wait(timeout=GRACE_S + 60)
            took = time.monotonic() - sent
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    return code, took, (tmp_path / "stderr").read_text(), processes, shm_left(shm_before)


def stopped_after_a_checkpoint(run_dir, code, took, err, processes, left) -> int:
    """The step the run stopped after, once checked that it exited 143 within the grace period with that step's
    checkpoint complete and each step up to it logged once, saying how to resume, leaving nothing behind."""
    assert code == 143 and took < GRACE_S, (code, took, err[-3000:])
    steps = [h["step"] for h in logged(run_dir)]
    assert steps == list(range(1, len(steps) + 1)), steps
    stopped = steps[-1]
    assert err.strip().splitlines()[-1] == (f"rlcore: stopped on SIGTERM after step {stopped}; resume it from its step "
                                            f"{stopped} checkpoint with: rlcore run --resume {run_dir}"), err[-3000:]
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}" / STATE).is_file()
    assert "Traceback" not in err, err[-3000:]
    alive = outliving(processes, within=10)
    assert not alive, f"outlived the run: {alive}"
    assert not left, f"left in /dev/shm: {left}"
    return stopped


def test_sigterm_stops_after_a_checkpoint_of_the_step_and_resume_logs_what_the_uninterrupted_run_logged(
        tmp_path, warm_start_cache, uninterrupted):
    run_dir = tmp_path / "run"
    logged_before = random.randint(2, STEPS - 2)     # the signal comes during step 3..7 (or as one ends)
    stopped = stopped_after_a_checkpoint(run_dir, *sigterm_when(
        tmp_path, rlcore_run(run_dir, warm_start_cache, *LAYOUT, f"trainer.stop_grace_s={GRACE_S}"),
        lambda run: len(logged(run_dir)) >= logged_before))
    assert stopped in (logged_before, logged_before + 1), (logged_before, stopped)
    resumed = run_to_end(rlcore_run(run_dir, warm_start_cache, "--resume"))
    assert f"resuming from {run_dir}/checkpoints/step_{stopped:08d}" in resumed.stderr
    assert without_timings(logged(run_dir)) == list(uninterrupted), f"stopped after step {stopped}"


def test_sigterm_stops_an_async_run_after_a_checkpoint_of_the_step(tmp_path, warm_start_cache):
    """The rollout worker generating for the next steps as the signal comes; no checkpoint before it (save_every 0)."""
    run_dir = tmp_path / "run"
    stopped_after_a_checkpoint(run_dir, *sigterm_when(
        tmp_path, async_quickstart(run_dir, warm_start_cache, f"trainer.stop_grace_s={GRACE_S}", steps=50),
        lambda run: len(logged(run_dir)) >= 2))
