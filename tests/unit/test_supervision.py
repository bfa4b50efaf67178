"""SIGTERM and restarts as logic (rlcore.supervision; the real runs: tests/e2e/test_supervision_e2e.py): the cadence's
answer to whether the run stops after a step (a checkpoint of that step, written once, complete); a real SIGTERM to a
real process tree, stopped by the process itself within the grace period, or past it by the watchdog with its
descendants; and what a worker's death restarts, and with which arguments and line."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlcore import supervision
from rlcore.cadence import Cadence


class Checkpointer:
    def __init__(self, every):
        self.every, self.calls = every, []

    def due(self, step):
        return bool(self.every) and step % self.every == 0

    def finish(self, blocking=False):
        self.calls.append(("finish", blocking))
        return True


class Stop:
    requested = False


def cadence(every):
    checkpointer, saved, stop = Checkpointer(every), [], Stop()
    return Cadence(None, None, "", checkpointer, evaluate=None, save=lambda step: saved.append(step) or 0.0,
                   profiled=(None, None), stop=stop), checkpointer, saved, stop


@pytest.mark.parametrize("every, step, saves", [(4, 3, [3]), (4, 4, []), (0, 5, [5])])
def test_a_stop_checkpoints_the_step_once_and_waits_for_the_write(every, step, saves):
    """Asked to stop: the step's checkpoint is written unless save_every has just started it, and in either case
    waited for until complete and visible; not asked: nothing."""
    run, checkpointer, saved, stop = cadence(every)
    assert not run.stopping(step) and saved == [] and checkpointer.calls == [] and run.stopped_after is None
    stop.requested = True
    assert run.stopping(step)
    assert saved == saves and checkpointer.calls == [("finish", True)] and run.stopped_after == step


STOPPABLE = """
import subprocess, sys, time
from rlcore.supervision import StopRequest

stop = StopRequest({grace}, lambda: "the grace period ran out")
stop.install()
child = subprocess.Popen([sys.executable, "-c", {child!r}])     # a descendant: a worker, an engine
print(child.pid, flush=True)
while not ({asks} and stop.requested):          # a step that ends (asks) or never does
    time.sleep(0.01)
print("stopping on my own", file=sys.stderr, flush=True)
child.terminate()
child.wait()
stop.finished()
sys.exit(143)
"""
SLEEPS = "import time; time.sleep(600)"
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def sigterm(grace, asks, child):
    """A process running STOPPABLE, given SIGTERM once its descendant runs: its exit code, the seconds it took to
    exit, its stderr, and the descendant."""
    process = subprocess.Popen([sys.executable, "-c", STOPPABLE.format(grace=grace, asks=asks, child=child)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        descendant = psutil.Process(int(process.stdout.readline()))
        time.sleep(0.2)                 # the descendant's own handlers in place
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = process.wait(timeout=60)
        took = time.monotonic() - sent
        return code, took, process.stderr.read(), descendant
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_is_a_request_the_run_answers_itself():
    code, took, err, descendant = sigterm(grace=30, asks=True, child=SLEEPS)
    assert code == 143 and took < 10, (code, took, err)
    assert err.strip().splitlines()[-1] == "stopping on my own", err
    assert "the grace period ran out" not in err and ended(descendant)


@pytest.mark.parametrize("child", [SLEEPS, DEAF], ids=["descendant-stops", "descendant-ignores-sigterm"])
def test_past_the_grace_period_the_watchdog_ends_the_process_tree(child):
    """The step never ends: at the grace period's end the run prints its last line and exits 143, its descendant
    ended (given SIGTERM, then SIGKILL a quarter of the grace period before the end)."""
    grace = 2.0
    code, took, err, descendant = sigterm(grace=grace, asks=False, child=child)
    assert code == 143, (code, err)
    assert grace - 1.0 < took < grace + 5.0, took        # the deadline, not before (a loaded machine: some slack)
    assert err.strip().splitlines()[-1] == "the grace period ran out", err
    assert ended(descendant)


def test_restarts_travel_in_the_environment_and_leave_it(monkeypatch):
    monkeypatch.delenv(supervision.RESTARTS_ENV, raising=False)
    assert supervision.restarts_so_far() == []
    restarts = [{"after_step": 5, "from_step": 4, "why": "actor worker rank 1 died"}]
    monkeypatch.setenv(supervision.RESTARTS_ENV, json.dumps(restarts))
    assert supervision.restarts_so_far() == restarts
    assert supervision.RESTARTS_ENV not in os.environ        # the workers started next do not inherit it


def test_what_a_death_restarts():
    assert supervision.may_restart([], 2, stop_requested=False)
    assert supervision.may_restart([{}], 2, stop_requested=False)
    assert not supervision.may_restart([{}, {}], 2, stop_requested=False)          # the budget is used
    assert not supervision.may_restart([], 0, stop_requested=False)                # the default: no restarts
    assert not supervision.may_restart([], 2, stop_requested=True)                 # SIGTERM came first: stop


def test_a_restart_continues_the_run_directory_from_its_newest_checkpoint_or_starts_again():
    assert supervision.restart_overrides("runs/x", checkpointed=True) == ["run.dir=runs/x", "trainer.resume=latest"]
    assert supervision.restart_overrides("runs/x", checkpointed=False) == ["run.dir=runs/x"]
    death = "actor worker rank 1 (pid 7 on h) died during train_step: its process was killed"
    assert supervision.restart_line(death, (4, "runs/x/checkpoints/step_00000004"), 1, 2) == \
        f"rlcore: {death}; restarting from its step 4 checkpoint (restart 1 of 2)"
    assert supervision.restart_line(death, None, 2, 2) == \
        f"rlcore: {death}; restarting from the start (no complete checkpoint yet) (restart 2 of 2)"
    assert supervision.budget_used(0) == ""                  # no restarts: today's line
    assert supervision.budget_used(1) == " (trainer.max_restarts=1: the restart used)"
    assert supervision.budget_used(3) == " (trainer.max_restarts=3: all 3 restarts used)"
