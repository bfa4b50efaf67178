"""A Ray worker killed mid-run (SIGKILL, as the kernel's OOM killer does) stops `rlcore run` within 30 s: exit code
non-zero, the other workers gone, and stderr ending in one line that names the worker, where it sat, what it was
doing and how to resume, with no traceback."""
import os
import re
import signal
import time

import psutil
import pytest

from runs import EVERY, logged, ray_workers, rlcore_run, start, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.parallel]


def gone(process: psutil.Process, within: float) -> bool:
    try:
        process.wait(timeout=within)
    except psutil.TimeoutExpired:
        return process.status() == psutil.STATUS_ZOMBIE
    return True


def test_a_killed_worker_stops_the_run_with_one_line(tmp_path, warm_start_cache):
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    with open(tmp_path / "stderr", "w") as stderr, open(tmp_path / "stdout", "w") as stdout:
        run = start(rlcore_run(run_dir, warm_start_cache, "trainer.world_size=2"), stdout=stdout, stderr=stderr)

        def mid_run():     # step 5 logged, after the checkpoint of step 4: what to kill, and a run to resume
            if len(logged(run_dir)) > EVERY and checkpoint.exists():
                found = ray_workers(run.pid, "ActorRolloutWorker")
                return found if len(found) == 2 else None

        try:
            workers = wait_until(run, mid_run)
            victim = workers[1]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            code = run.wait(timeout=60)
            took = time.monotonic() - killed_at
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    assert code != 0 and took < 30, (code, took, err[-3000:])
    last = err.strip().splitlines()[-1]
    line = re.fullmatch(rf"rlcore: error: actor worker rank (\d) \(tp 0, pp 0, cp 0, ep 0, dp \1; pid {victim.pid} on "
                        rf"\S+\) died during (\w+): its process was killed \(Ray: SYSTEM_ERROR, .*\); resume it from "
                        rf"its step {EVERY} checkpoint with: rlcore run --resume {run_dir}", last)
    assert line, err[-3000:]
    assert line[2] in {"episodes", "rollout_mode", "train_mode", "logprobs", "train_step", "compare_logprobs",
                       "save_checkpoint", "finish_checkpoint"}, last      # episodes: generating (training or eval)
    assert "Traceback" not in err and "ActorDiedError" not in err, err[-3000:]
    assert gone(workers[0], within=30), "the other worker outlived the run"
