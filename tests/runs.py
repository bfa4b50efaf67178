"""How tests start, watch and kill `rlcore run` as a user would run it: the checkpoint tests kill a whole run and
resume it, the dead-worker test kills one of its Ray workers."""
import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from zygote import Zygote, kill_group

STEPS, EVERY = 8, 4          # checkpoints after steps 4 and 8
SHORT_QUICKSTART = ["trainer.steps=50", "trainer.eval_every=0", "run.progress=false"]   # the preset, fewer RL steps
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
_ZYGOTE = Zygote()            # forks this test process's `rlcore run`s (tests/zygote.py)
atexit.register(_ZYGOTE.close)
# the runs kept out of the suite's time (each with a comment naming what covers its parts in every run)
ON_REQUEST = pytest.mark.on_request      # deselected unless RLCORE_ALL_LAYOUTS=1 (rlcore-testing's pytest plugin)


def rlcore_run(run_dir, warm_start_cache, *extra, preset="quickstart", plugins="qwen3,grpo,ppo,vllm"):
    """A preset for a few steps with checkpoints (``extra``: overrides), or ``--resume`` of ``run_dir``."""
    command = [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}"]
    if extra[:1] == ("--resume",):
        return command + ["--resume", str(run_dir)]
    return command + [preset, f"trainer.steps={STEPS}", f"trainer.save_every={EVERY}", "trainer.eval_every=4",
                      "run.progress=false", f"run.dir={run_dir}", f"warm_start.cache_dir={warm_start_cache}", *extra]


def run_cli(cmd, env=None, timeout=600) -> subprocess.CompletedProcess:
    """``cmd`` run to its end, its output captured as text: subprocess.run(capture_output=True, text=True), but
    forked where it can be (``start``), and its whole process group killed after ``timeout`` s. ``env``: this
    process's environment by default."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = start(cmd, stdout=out, stderr=err, env=dict(os.environ) if env is None else env)
        try:
            code = process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def run_to_end(cmd, env=ENV, timeout=600) -> subprocess.CompletedProcess:
    """``run_cli``, asserted to exit 0."""
    result = run_cli(cmd, env, timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV):
    """``cmd`` in a session of its own, so that killing its process group reaches its engines and Ray: forked from
    this test process's zygote where it is an `rlcore run` the zygote can fork (tests/zygote.py), else a process of
    its own. Either has Popen's pid, poll(), wait() and returncode. ``stdout``/``stderr``: DEVNULL or open files."""
    env = without_leaks(env)
    with open(os.devnull, "w") as devnull:
        fds = [devnull.fileno() if s == subprocess.DEVNULL else s.fileno() for s in (stdout, stderr)]
        forked = _ZYGOTE.spawn(cmd, env, *fds)
    if forked is not None:
        return forked
    return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, start_new_session=True)


def torchrun(procs: int, script, *args, timeout: float = 300, env=ENV) -> subprocess.CompletedProcess:
    """``python script args...`` on ``procs`` local ranks, as ``torchrun --nproc_per_node=procs`` runs it (the same
    variables per rank; a rank that fails ends the others; the ranks' outputs one after the other), each rank forked
    from the zygote. Where the zygote refuses, torchrun itself runs it."""
    from rlcore.launch import free_port, torchrun as torchrun_command

    cmd = [sys.executable, str(script), *map(str, args)]
    port, ranks = free_port(), []
    with contextlib.ExitStack() as files:
        outputs = [tuple(files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)) for _ in range(procs)]
        for rank, (out, err) in enumerate(outputs):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                        "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs), "ROLE_WORLD_SIZE": str(procs),
                        "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0"}
            forked = _ZYGOTE.spawn(cmd, without_leaks(rank_env), out.fileno(), err.fileno())
            if forked is None:
                for started in ranks:
                    kill_group(started.pid)
                    started.wait()
                return subprocess.run([*torchrun_command(procs), *cmd[1:]], capture_output=True, text=True,
                                      timeout=timeout, env=env)
            ranks.append(forked)
        code, deadline = 0, time.monotonic() + timeout
        try:
            while None in (codes := [r.poll() for r in ranks]) and not any(codes):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.05)
            code = next((c for c in codes if c), 0)
        finally:
            for r in ranks:
                if r.poll() is None:
                    kill_group(r.pid)
                    r.wait()
        texts = []
        for out, err in outputs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    return subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in texts), "".join(e for _, e in texts))


@contextlib.contextmanager
def ray_workers_forked():
    """Within it, a Run made in this test process (not an `rlcore run` forked by ``start``) gets Ray workers forked
    from the zygote, as a forked run's are (tests/ray_worker.py): their imports were most of a layout test's time.
    A worker the zygote refuses (an environment that differs where it matters) starts as Ray starts it."""
    added = {} if os.environ.get("RLCORE_TEST_FORK") == "0" else _ZYGOTE.ray_env()
    before = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def without_leaks(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what this test process's own in-process work added to its environment since it started, with
    the value it added (SGLang's plugin sets a dozen variables as its tests install its CPU shims; a tracker sets its
    own): a run must not see what an earlier test in the same process left, which also made the zygote refuse to
    fork every run after it (tests/zygote.py). A variable the caller sets to another value is kept."""
    return {k: v for k, v in env.items() if k in ENV or os.environ.get(k) != v}


def wait_until(process, condition, timeout=1200):
    """What ``condition()`` returns once it holds, polled while ``process`` runs. The timeout only catches a hung
    run: beside another test on two cores, a TP2 x PP2 run took over 300 s to its first checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = condition()
        if seen:
            return seen
        assert process.poll() is None, "the run ended before it could be killed"
        time.sleep(0.005)
    raise AssertionError("the kill condition never held")


def kill_when(cmd, condition, timeout=1200):
    """Start ``cmd``, SIGKILL it as soon as ``condition()`` holds; returns what the condition saw. A run that ends
    first fails the test with the end of its stderr (kept in a temporary file: a pipe nobody reads would block it)."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = start(cmd, stderr=stderr)
        try:
            seen = wait_until(process, condition, timeout)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return seen
        except AssertionError as e:
            stderr.seek(0)
            raise AssertionError(f"{e}: {stderr.read()[-4000:]}") from None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def logged(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


# What a run reads off the clock, which no two runs share: the phases' times, and the seconds tools took (summed over
# the step's calls, each timed from its start on the agent's threads or loop to its result).
WALL_CLOCK = ("time/", "agent/tool_seconds")


def without_timings(history):
    return [{k: v for k, v in h.items() if not k.startswith(WALL_CLOCK)} for h in history]


def ray_workers(driver_pid: int, actor_class: str) -> list[psutil.Process]:
    """The run's Ray workers of ``actor_class``: Ray names their processes after the class
    (``ray::ActorRolloutWorker...``), as it does the processes they fork (a checkpoint's writers), which are not Ray's
    children."""
    found = []
    for process in run_processes(driver_pid):
        try:
            if process.cmdline()[0].startswith(f"ray::{actor_class}") and \
                    not process.parent().cmdline()[0].startswith("ray::"):
                found.append(process)
        except (psutil.NoSuchProcess, IndexError):
            pass
    return found


def run_processes(driver_pid: int) -> list[psutil.Process]:
    """The run's processes: the driver's descendants, and the Ray workers the test zygote forked for it (children of
    the zygote, whose stand-ins are the driver's descendants: tests/ray_worker.py) with theirs."""
    found = psutil.Process(driver_pid).children(recursive=True)
    ours = {p.pid for p in found}
    for fork, stand_in in _ZYGOTE.stand_ins().items():
        if stand_in in ours:
            try:
                worker = psutil.Process(fork)
                found += [worker, *worker.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return found


def shm_segments() -> set[str]:
    """rlcore's /dev/shm segments now (weight pushes, resharder slots, vLLM's LoRA adapter directories)."""
    return set(glob.glob("/dev/shm/rlcore-*"))


def shm_left(before: set[str]) -> list[str]:
    """For a run without LoRA: the segments made since ``before`` and still there. It makes no LoRA adapter
    directory, so one seen is another test's, alive as long as that test's engine (tens of seconds)."""
    new = {p for p in shm_segments() - before if not os.path.basename(p).startswith("rlcore-lora-")}
    if new:
        time.sleep(2)            # a segment of another test's run lives for milliseconds (created, mapped, unlinked)
    return sorted(p for p in new if os.path.exists(p))


def async_quickstart(run_dir, warm_start_cache, *extra, plugins="qwen3,grpo,vllm", steps=5):
    """The quickstart in async mode for ``steps`` steps: one rollout worker, max_staleness 1, evaluated only before
    and after, no export (``extra``: overrides)."""
    return [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}", "quickstart", f"trainer.steps={steps}",
            "trainer.eval_every=0", "run.progress=false", "trainer.export_hf=false", f"run.dir={run_dir}",
            f"warm_start.cache_dir={warm_start_cache}", "trainer.mode=async", "rollout.max_staleness=1", *extra]


def install_distribution(root, dist, module, body, entry="fake"):
    """A real distribution in directory ``root`` (for sys.path or PYTHONPATH): <dist>.dist-info with METADATA and
    entry_points.txt (``entry`` = ``module`` in rlcore's group), and its module with ``body``."""
    info = root / f"{dist.replace('-', '_')}-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text(f"[rlcore]\n{entry} = {module}\n")
    (root / f"{module}.py").write_text(body)


def shared_tmp(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this test run sees (the workers' base temps are its subfolders);
    without xdist, this process's base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_warm_start_cache(tmp_path_factory, preset: str, plugins: list[str]) -> Path:
    """This test process's warm-start cache, holding ``preset``'s starting checkpoint from the start (``plugins``:
    those its runs load). That entry, which the preset's runs start from, is built once for the whole test run: under
    a file lock in a folder every xdist worker sees, by the first worker to get here, while the other waits; each
    worker gets a copy (4 MB). The cache itself is not shared: rlcore publishes an entry it has built by removing any
    entry of the same settings and renaming its own into place, so two workers building the same settings at once
    would remove one from under the other's runs."""
    from filelock import FileLock

    shared = shared_tmp(tmp_path_factory) / f"warm_start_{preset}"
    with FileLock(f"{shared}.lock"):
        built = prepared_model(preset, shared, plugins)
    cache = tmp_path_factory.mktemp(f"warm_start_cache_{preset}")
    shutil.copytree(built, cache / os.path.basename(built))
    return cache


def prepared_model(preset: str, cache, plugins: list[str]) -> str:
    """The preset's starting checkpoint in ``cache`` (at once when cached), as its runs prepare it; its path. A
    cache can hold several (runs with other warm-start settings add theirs)."""
    import torch

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.warm_start import starting_checkpoint

    cfg = load_config(preset, [f"warm_start.cache_dir={cache}"])
    with torch.random.fork_rng():       # the worker's random state stays as the tests after it expect
        return starting_checkpoint(cfg, load_plugins(plugins).registry)
