"""How `rlcore run` stops when asked to and starts again when a worker dies (issue 42).

**SIGTERM** (what SLURM and Kubernetes send first when they preempt a job) is a request to stop (``StopRequest``):
the loop asks once per step (``Cadence.stopping``), and the run stops after the step under way with that step's
checkpoint written and visible, its workers stopped, and exits with status 143 (128 + SIGTERM). That is the status of
a job that SIGTERM ended, and schedulers read it so: the job was terminated, not completed (a Kubernetes Job counts
the pod failed and starts another, which ``--resume`` continues; a podFailurePolicy can match 143; SLURM requeues
it). Status 0 would tell them that unfinished training is done. If the step and its checkpoint have not ended
``trainer.stop_grace_s`` after the signal, a watchdog thread ends the run's processes (SIGTERM, then SIGKILL for those
still running a few seconds before the deadline) and exits 143 at the deadline with no new checkpoint: the newest
complete one stands.

**A worker that dies** (``WorkerDied`` reaching `rlcore run`) restarts the job from the run directory's newest
complete checkpoint, up to ``trainer.max_restarts`` times (``restart``). A restart executes the same command again
(``os.execve``) once the dead attempt's workers and Ray are stopped, with the run directory and that checkpoint
pinned: a fresh interpreter, the same pid (which the scheduler watches and signals). Restarting inside the process
would have to undo what the dead attempt left in it, and it cannot be sure to: with trainer.world_size=1 the trainer
and the colocated vLLM engine live in the driver, with megatron-core's and torch.distributed's global state, the
engines' and Ray's threads, and whatever a call into the dead worker still holds. A fresh process starts from none of
it, and takes the path the checkpoint tests prove exact (`rlcore run --resume`); it costs the imports, seconds. The
restarts so far travel in the environment (``RESTARTS_ENV``), read and removed as the command starts so that no
worker inherits them.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

log = logging.getLogger(__name__)

STOPPED_EXIT = 128 + signal.SIGTERM      # 143: what a job ended by SIGTERM exits with
RESTARTS_ENV = "RLCORE_RESTARTS"         # the restarts so far, JSON, for the command executed again
KILL_S = 5.0                             # of the grace period: what the run's processes get between SIGTERM and SIGKILL


class Stopped(Exception):
    """The run stopped on request after ``step``, which is checkpointed."""

    def __init__(self, step: int):
        super().__init__(f"stopped on SIGTERM after step {step}")
        self.step = step


class StopRequest:
    """SIGTERM, taken in the main thread as a request to stop after the step under way (``requested``). From the
    signal on, a watchdog thread gives the run ``grace_s`` seconds: past them it prints ``last_words()`` (unless the
    run has said ``finished()``), ends this process's descendants and exits ``STOPPED_EXIT``. The main thread takes
    the signal at once in Python code, within a second while it waits on Ray (which checks for signals once a
    second)."""

    def __init__(self, grace_s: float, last_words: Callable[[], str]):
        self.grace_s, self.last_words = grace_s, last_words
        self.received_at: float | None = None
        self._finished = threading.Event()

    def install(self) -> None:
        """Take SIGTERM, where this is the main thread (elsewhere Python cannot: SIGTERM stays as it was)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.received)

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def received(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        if self.received_at is not None:      # another SIGTERM: the first one's deadline stands
            return
        self.received_at = time.monotonic()
        log.warning("SIGTERM: the run stops after the step under way, with its checkpoint (trainer.stop_grace_s=%g s)",
                    self.grace_s)
        threading.Thread(target=self._watch, name="rlcore-stop-watchdog", daemon=True).start()

    def finished(self) -> None:
        """The stop is done (the run's last line printed): the watchdog, if it still fires, only ends the process."""
        self._finished.set()

    def _watch(self) -> None:
        kill_s = min(KILL_S, self.grace_s / 4)
        time.sleep(self.grace_s - kill_s)
        if not self._finished.is_set():
            print(self.last_words(), file=sys.stderr, flush=True)
        end_descendants(kill_s)
        sys.stdout.flush()
        os._exit(STOPPED_EXIT)


def end_descendants(within: float) -> None:
    """This process's descendants (an embedded Ray node and its workers, engines, checkpoint writers)."""
    import psutil

    end_processes(psutil.Process().children(recursive=True), within)


def end_processes(processes: list, within: float) -> None:
    """SIGTERM to ``processes`` (psutil's), which lets them free what they hold (shared memory), then SIGKILL for those
    still running ``within`` seconds later."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=within)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=1)


# --- restarts ----------------------------------------------------------------------------------------------------
def restarts_so_far() -> list[dict]:
    """This command's restarts so far (``restart``), taken out of the environment: the workers it starts must not
    inherit them."""
    given = os.environ.pop(RESTARTS_ENV, "")
    return json.loads(given) if given else []


def may_restart(restarts: list[dict], max_restarts: int, stop_requested: bool) -> bool:
    """Whether a worker's death restarts the job: restarts are left, and no stop was asked for."""
    return len(restarts) < max_restarts and not stop_requested


def restart_overrides(run_dir: str, checkpointed: bool) -> list[str]:
    """What the command executed again adds to its own arguments: the run directory it writes (a run.dir left unset
    was named after the start time) and, if the run has a complete checkpoint, the newest (else the command starts
    again as it was given: afresh, or from its own trainer.resume)."""
    return [f"run.dir={run_dir}", *(["trainer.resume=latest"] if checkpointed else [])]


def restart_line(death: str, newest: tuple[int, str] | None, number: int, max_restarts: int) -> str:
    """The one line a restart prints: the death, and where the job starts again."""
    start = f"its step {newest[0]} checkpoint" if newest else "the start (no complete checkpoint yet)"
    return f"rlcore: {death}; restarting from {start} (restart {number} of {max_restarts})"


def budget_used(max_restarts: int) -> str:
    """What a death after the last restart adds to its line (nothing without restarts)."""
    if not max_restarts:
        return ""
    used = "the restart" if max_restarts == 1 else f"all {max_restarts} restarts"
    return f" (trainer.max_restarts={max_restarts}: {used} used)"


def restart(args: list[str], env: dict[str, str], restarts: list[dict]) -> NoReturn:
    """Execute `rlcore` with ``args`` (its own, then ``restart_overrides``) again in this process, in ``env`` (the
    environment it started with) and with ``restarts`` for it to count on. Ray and the workers must be stopped."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rlcore.cli", *args],
              {**env, RESTARTS_ENV: json.dumps(restarts)})


def restart_run(argv: list[str], env: dict[str, str], run, death: str, restarts: list[dict]) -> NoReturn:
    """``trainer.max_restarts``: the dead attempt's workers and Ray are stopped; say why in one line and run the same
    command (``argv``, in ``env``) again from ``run``'s newest complete checkpoint."""
    from rlcore.checkpoint import complete_checkpoints

    found = complete_checkpoints(run.run_dir)
    newest = found[-1] if found else None
    print(restart_line(death, newest, len(restarts) + 1, run.cfg.trainer.max_restarts), file=sys.stderr)
    restarts = [*restarts, {"after_step": run.last_step(), "from_step": newest[0] if newest else 0, "why": death}]
    restart([*argv, *restart_overrides(run.run_dir, newest is not None)], env, restarts)


def grace_ran_out(cfg) -> str:
    """The line a run prints when SIGTERM's grace period ends before its stop did."""
    from rlcore.checkpoint import how_to_resume

    return (f"rlcore: stopped on SIGTERM: the run did not stop within trainer.stop_grace_s="
            f"{cfg.trainer.stop_grace_s:g} s, its processes were ended; "
            f"{how_to_resume(cfg.run.dir) if cfg.run.dir else 'run it again'}")
