"""Async mode's failures end to end (real vLLM in a Ray rollout worker, real megatron-core trainer): a trainer worker
killed stops `rlcore run` within 30 s with one line naming it, its processes gone (a killed rollout worker is healed:
test_async_healing.py; without replacements the run stops when none is left: tests/unit/test_roster.py); a request
that hangs (an engine told to sleep) is timed out and counted, where without rollout.request_timeout the run would
hang."""
import os
import re
import signal
import socket
import subprocess
import time

import psutil
import pytest

from runs import (ENV, ON_REQUEST, async_quickstart, install_distribution, logged, ray_workers, run_processes,
                  run_to_end, start, wait_until)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.parallel]

HOST = re.escape(socket.gethostname())
KILLED = r"its process was killed \(Ray: SYSTEM_ERROR, [^)]*\)"


def kill_mid_run(tmp_path, cache, actor_class, count, doing, *extra):
    """A long async run with ``count`` ``actor_class`` workers, one of them SIGKILLed once 3 steps are logged while it
    runs method ``doing`` (Ray titles a worker's process with the method it runs). Returns the victim, the run's exit
    code (None: still running 60 s after), the seconds it took to exit, its stderr, and the run's other processes (Ray's
    own included)."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as stderr:
        run = start(async_quickstart(run_dir, cache, *extra, steps=1000), stderr=stderr)

        def mid_run():
            if len(logged(run_dir)) >= 3:
                found = ray_workers(run.pid, actor_class)
                busy = [p for p in found if title(p) == f"ray::{actor_class}.{doing}"]
                return busy if len(found) == count and busy else None

        try:
            victim = wait_until(run, mid_run, timeout=300)[0]
            others = [p for p in run_processes(run.pid) if p.pid != victim.pid]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            try:
                code = run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - killed_at
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    return victim, code, took, (tmp_path / "stderr").read_text(), others


def title(process: psutil.Process) -> str:
    try:
        return process.cmdline()[0]
    except (psutil.NoSuchProcess, IndexError):
        return ""


def outliving(processes: list[psutil.Process], within: float) -> list[psutil.Process]:
    """Those of ``processes`` still running ``within`` seconds from now (a zombie has ended: nobody reaps the run's
    orphans in a container whose init does not)."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def stopped_with_one_line(code, took, err, others) -> str:
    """The run's last line, once checked that it exited non-zero within 60 s (a hung push waits its own 300 s; beside
    the whole suite on 2 cores a prompt stop took 33.7 s once), without a traceback, leaving nothing."""
    assert code not in (0, None) and took < 60, (code, took, err[-3000:])
    assert "Traceback" not in err and "ActorDiedError" not in err, err[-3000:]
    alive = outliving(others, within=30)
    assert not alive, f"outlived the run: {alive}"
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("doing", ["answer", "push_weights"])
def test_a_killed_trainer_worker_stops_the_run_with_one_line(tmp_path, warm_start_cache, doing):
    """Two trainer processes beside the rollout worker, the producer thread generating; one killed while it computes
    (``answer``: logprobs or a training step) or while it pushes the weights."""
    victim, code, took, err, others = kill_mid_run(tmp_path, warm_start_cache, "ActorWorker", 2, doing,
                                                   "trainer.world_size=2")
    last = stopped_with_one_line(code, took, err, others)
    assert re.fullmatch(rf"rlcore: error: actor worker rank ([01]) \(tp 0, pp 0, cp 0, ep 0, dp \1; pid {victim.pid} "
                        rf"on {HOST}\) died during \w+: {KILLED}; .+", last), err[-3000:]


SLEEPY_BACKEND = '''"""vLLM whose engine sleeps instead of answering one request: a straggler, or an engine that hangs.
The request is the first of training's (the queued source tags them f"d{{draw}}-..."; evaluation's f"eval..."): a
sample of one of the groups started at once for the first S + 1 = 2 steps, in flight when step 1's push comes."""
import asyncio
import pathlib

from rlcore.hookspecs import hookimpl
from rlcore.specs import RolloutBackendSpec
from rlcore_rollout_vllm.backend import VLLMRollout

MARKER = pathlib.Path({marker!r})


class SleepyVLLM(VLLMRollout):
    async def generate(self, tokens, sampling, seed, request_id):
        if request_id.startswith("d") and not MARKER.exists():
            MARKER.write_text(request_id)
            await asyncio.sleep(3600)
        return await super().generate(tokens, sampling, seed, request_id)


def make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True):
    return SleepyVLLM(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                      load_weights=load_weights)


@hookimpl
def rlcore_rollout_backends():
    return [RolloutBackendSpec("sleepy_vllm", make)]
'''
TIMEOUT_S, STEPS, BATCH = 5, 4, 16      # BATCH: the quickstart's trainer.prompts_per_step


@pytest.fixture
def sleepy(tmp_path):
    """The environment of a run whose engine hangs on one request (the plugin on PYTHONPATH), and the file that says
    the hang began (holding the request's id)."""
    site, marker = tmp_path / "site", tmp_path / "hung"
    site.mkdir()
    install_distribution(site, "rlcore-sleepy-vllm", "sleepy_vllm", SLEEPY_BACKEND.format(marker=str(marker)),
                         entry="sleepy_vllm")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    return env, marker


def test_a_hung_request_is_timed_out_and_counted(tmp_path, warm_start_cache, sleepy):
    env, marker = sleepy
    run_dir = tmp_path / "run"
    run_to_end(async_quickstart(run_dir, warm_start_cache, "rollout.backend=sleepy_vllm",
                                f"rollout.request_timeout={TIMEOUT_S}", plugins="qwen3,grpo,sleepy_vllm",
                                steps=STEPS), env=env)
    assert marker.exists(), "no training request was made: the test hung nothing"
    history = logged(run_dir)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert sorted(h["async/groups_timed_out"] for h in history) == [0] * (STEPS - 1) + [1]
    assert all(h["sampling/groups_kept"] == BATCH for h in history)       # its place was given back: full batches
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert max(h["time/step"] for h in history) < TIMEOUT_S + 30, [h["time/step"] for h in history]


@ON_REQUEST         # the suite's time: a run and a 45 s wait to show that the test above hangs something real
def test_without_a_timeout_the_hung_request_hangs_the_run(tmp_path, warm_start_cache, sleepy):
    """The other side of the test above: the hang is real (a push waits for the requests in flight)."""
    env, marker = sleepy
    run_dir = tmp_path / "run"
    run = start(async_quickstart(run_dir, warm_start_cache, "rollout.backend=sleepy_vllm",
                                 plugins="qwen3,grpo,sleepy_vllm", steps=STEPS), env=env)
    try:
        wait_until(run, marker.exists, timeout=300)
        time.sleep(45)          # with the timeout, the run ends ~8 s after the hang starts (its push waits 5 s)
        assert run.poll() is None and len(logged(run_dir)) < STEPS, logged(run_dir)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()


BROKEN_LOAD_BACKEND = '''"""vLLM whose engine fails halfway through loading its first weight push: a receiver that
errors but lives. It notes when, in the file MARKER."""
import pathlib
import time

from rlcore.hookspecs import hookimpl
from rlcore.specs import RolloutBackendSpec
from rlcore_rollout_vllm.backend import VLLMRollout

MARKER = pathlib.Path({marker!r})


class BrokenLoadVLLM(VLLMRollout):
    def update_weights(self, named_tensors, version):
        next(iter(named_tensors))             # the first tensor arrives; the rest of the push never will
        MARKER.write_text(str(time.time()))
        raise RuntimeError("the engine's weight loader broke (a test's)")


def make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True):
    return BrokenLoadVLLM(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                          load_weights=load_weights)


@hookimpl
def rlcore_rollout_backends():
    return [RolloutBackendSpec("broken_load_vllm", make)]
'''


def test_a_rollout_worker_that_fails_to_load_a_push_stops_the_run_with_its_error(tmp_path, warm_start_cache):
    """The receiver lives on and the sender is mid-push: its channel is closed, so the trainer hears at once (not
    after the push's 300 s timeout) and the line names the worker and its own error, not the channel's echo."""
    site, marker = tmp_path / "site", tmp_path / "broke"
    site.mkdir()
    install_distribution(site, "rlcore-broken-load-vllm", "broken_load_vllm",
                         BROKEN_LOAD_BACKEND.format(marker=str(marker)), entry="broken_load_vllm")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    with open(tmp_path / "stderr", "w") as stderr:
        run = start(async_quickstart(tmp_path / "run", warm_start_cache, "rollout.backend=broken_load_vllm",
                                     plugins="qwen3,grpo,broken_load_vllm", steps=4), stderr=stderr, env=env)
        try:
            code = run.wait(timeout=400)
            took = time.time() - float(marker.read_text())
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    assert code not in (0, None), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"rlcore: error: rollout worker 0 \(pid \d+ on {HOST}\) failed: .*the engine's weight loader "
                        rf"broke \(a test's\); .+", last), err[-3000:]
    assert took < 30, (took, err[-3000:])         # the push's own timeout: 300 s
