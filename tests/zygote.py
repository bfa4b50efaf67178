"""`rlcore run` processes forked from a process that has already imported torch, transformers, megatron-core and vLLM.

Each run the tests start is a whole `python -m rlcore.cli ...` process, and before it does anything it imports those
libraries: ~12 s of CPU on a quiet machine, ~50 s of wall beside the rest of the suite on two cores, for runs whose
own work is often less (the quickstart's 2 steps: 23 s exec'd, 7 s forked). A zygote (one per test process) imports
them once and forks a child per run; the child takes the run's argv, environment, working directory and standard
streams, runs ``rlcore.cli`` as ``python -m`` does, and exits as the interpreter does (threads joined, atexit
handlers: Ray's shutdown, temporary files) but for the teardown of every module. rlcore itself is imported fresh in
every child. The zygote imports and computes nothing else (one thread, no torch thread pool, no Ray cluster), so a
fork is what a fresh interpreter would be after the same imports.

A run is forked only where nothing read at import could differ (the zygote checks, ``_differs``): the same
interpreter, the environment the test process started with but for what is read only after the fork (PYTHONPATH, put
on sys.path as the interpreter would; Ray's variables: Ray is not imported in the zygote, as it reads its settings
once, at import) and what the zygote's own imports set, and no SGLang (which patches transformers as it is imported).
Anything else starts a process as before; ``RLCORE_TEST_FORK=0`` starts every run that way. A Python script run the
same way (``python bench/<script>.py --smoke``: a benchmark's smoke) is forked too, with its own directory first on
sys.path as the interpreter puts it; what it starts itself starts afresh.

A forked run's Ray workers are forked from the zygote too: the run's Ray job names tests/ray_worker.py as its workers'
Python (Ray's ``py_executable``), which asks the zygote to run Ray's worker script in a fork (the same checks) and
stands in for it to the raylet that started it, exiting as it does; the fork is killed if that stand-in is. Where the
zygote refuses, it execs Python as Ray would have.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

PRELOAD = ["torch", "transformers", "transformers.models.auto.tokenization_auto",
           "transformers.models.auto.modeling_auto", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
           "vllm", "vllm.entrypoints.llm", "matplotlib.pyplot", "safetensors.torch", "pyarrow.parquet",
           "transformers.models.qwen3.configuration_qwen3"]
MODULE = "rlcore.cli"
# what torchrun gives each rank (runs.torchrun gives a forked rank the same): torch.distributed reads it as a process
# group starts, after the fork
RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS")
# what a run or a Ray worker may have in its environment that the zygote has not, all read after the fork: where
# PYTHONPATH points, the running test's name, what Ray adds for its workers (RAY_* too: Ray is imported after the
# fork), what a run sets for its workers (vLLM reads it as an engine starts), what megatron-core sets as it builds a
# model (NVTE_*: Transformer Engine's, not installed), and where the zygote's children find it
READ_AFTER_FORK = {"PYTHONPATH", "PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT", "SPT_NOENV",
                   "VLLM_ENABLE_V1_MULTIPROCESSING", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
                   "RLCORE_TEST_ZYGOTE", "RAY_JOB_CONFIG_JSON_ENV_VAR", *RANK_ENV}
IMPORTED_ENV: dict[str, str] = {}    # what PRELOAD's imports set in the environment (vLLM does), given to each child
RAY_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_worker.py")
STARTING_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}   # the test process's, before its own imports changed it


# --- the zygote's side -------------------------------------------------------------------------------------------
def serve(path: str) -> dict | None:
    """Import PRELOAD, then answer spawn requests on the Unix socket ``path`` until stdin closes (the test process
    ended). Returns only in a forked child: the request it is to run. A Ray worker's fork is killed when the
    connection of its stand-in closes first (the stand-in was killed)."""
    before = dict(os.environ)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")     # as rlcore.cli sets it before it imports vLLM
    sys.meta_path.insert(0, _WITHOUT_RAY)
    for name in PRELOAD:
        __import__(name)
    sys.meta_path.remove(_WITHOUT_RAY)
    _forget_ray_less_modules()
    IMPORTED_ENV.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    os.environ.clear()
    os.environ.update(before)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    ended, wake = socket.socketpair()          # a child's end wakes the loop (SIGCHLD through Python's wakeup fd)
    wake.setblocking(False)
    signal.set_wakeup_fd(wake.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    selector.register(ended, selectors.EVENT_READ, "ended")
    children: dict[int, socket.socket] = {}
    stand_ins: dict[int, int] = {}         # a Ray worker's fork -> the process that stands in for it (its pid)
    while True:
        for key, _ in selector.select(timeout=1):
            if key.data == "parent":
                for pid in children:
                    kill_group(pid)
                return None
            if key.data == "ended":
                ended.recv(4096)
                continue
            if key.data == "accept":
                connection, _ = listener.accept()
                selector.register(connection, selectors.EVENT_READ, "request")
                continue
            if key.data == "watch":       # a Ray worker's stand-in ended before its fork did
                connection = key.fileobj
                selector.unregister(connection)
                for pid, watched in children.items():
                    if watched is connection:
                        kill_group(pid)
                continue
            connection = key.fileobj
            selector.unregister(connection)
            request, fds = _receive(connection)
            if request is None:
                connection.close()
                continue
            if request.get("query") == "stand_ins":
                connection.sendall(json.dumps(stand_ins).encode() + b"\n")
                connection.close()
                continue
            refused = _differs(request)
            if refused:
                for fd in fds:
                    os.close(fd)
                connection.sendall(json.dumps({"refused": refused}).encode() + b"\n")
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for sock in (selector, listener, ended, wake, connection, *children.values()):
                    sock.close()
                return _become(request, fds, path)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
            if request.get("stand_in"):
                selector.register(connection, selectors.EVENT_READ, "watch")
                stand_ins[pid] = _peer_pid(connection)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = children.pop(pid)
                stand_ins.pop(pid, None)
                if selector.get_map().get(connection) is not None:
                    selector.unregister(connection)
                try:
                    connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                connection.close()


class _WithoutRay:
    """An import finder under which Ray cannot be imported: Ray reads its C++ settings from the environment once, as
    it is imported (the raylet's pid, the job's id: a worker's own), so a process that forks Ray workers must not
    have imported it. vLLM imports it where it can, and does without."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests/zygote.py)", name=name)
        return None


_WITHOUT_RAY = _WithoutRay()


def _forget_ray_less_modules() -> None:
    """Modules imported under _WITHOUT_RAY that did without it (``ray = None``): imported again where a child uses
    them, with Ray (vLLM's ray_utils)."""
    for name, module in list(sys.modules.items()):
        if module is not None and "ray" in vars(module) and vars(module)["ray"] is None:
            del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
                delattr(sys.modules[parent], child)
    assert "ray" not in sys.modules


def _peer_pid(connection: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket."""
    pid, _, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _receive(connection: socket.socket):
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    if not data:
        return None, []
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


def _differs(request: dict) -> list[str]:
    """Why the request cannot be forked: the variables of its environment that differ from the zygote's where the
    zygote's imports could have read them, or SGLang among a run's plugins."""
    env = request["env"]
    differ = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)
                    and k not in READ_AFTER_FORK and not k.startswith("RAY_")
                    and (k not in IMPORTED_ENV or env[k] != IMPORTED_ENV[k]))
    plugins = next((a for a in request["argv"] if a.startswith("--plugins=")), "")
    return differ + (["SGLang"] if "script" not in request and "sglang" in plugins else [])


def ray_env(path: str) -> dict[str, str]:
    """What a run forked from the zygote at ``path`` needs for its Ray workers to be forked too: Ray's job config
    (read by ray.init) naming ray_worker.py as the workers' Python, and where it finds the zygote."""
    job = {"runtime_env": {"py_executable": f"{sys.executable} -S {RAY_WORKER}"}}
    return {"RLCORE_TEST_ZYGOTE": path, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}


def _become(request: dict, fds: list[int], zygote: str) -> dict:
    """In the forked child: the run's session, streams, directory, environment and sys.path."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(IMPORTED_ENV)    # as a fresh interpreter's imports would set them
    if "script" not in request and "RAY_JOB_CONFIG_JSON_ENV_VAR" not in request["env"]:
        os.environ.update(ray_env(zygote))
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(request["script"]) if "script" in request else request["cwd"]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
    import importlib
    import random

    import numpy

    importlib.invalidate_caches()
    random.seed()                 # seeded afresh, as a new interpreter's are: not the zygote's copies
    numpy.random.seed()
    return request


def run_child(request: dict) -> None:
    """``python -m rlcore.cli argv...`` (or ``python script argv...``) in this process, as the interpreter runs
    it, and its exit as the interpreter's up to the teardown of every module, skipped: with the zygote's thousands of
    modules it took ~2 s and does nothing a run's outcome shows (what must happen at exit is registered with
    atexit)."""
    import atexit
    import runpy
    import threading

    script = request.get("script")
    sys.argv = [script or MODULE, *request["argv"]]
    code = 0
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy._run_module_as_main(MODULE)      # type: ignore[attr-defined]   # what `python -m` calls
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()                      # type: ignore[attr-defined]   # the interpreter's exit, in order
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _exit_code(code) -> int:
    """The status SystemExit(code) exits with (a message is printed and exits 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# --- the tests' side ---------------------------------------------------------------------------------------------
class Forked:
    """A run forked by the zygote, with what tests use of subprocess.Popen: pid, poll, wait, returncode."""

    def __init__(self, connection: socket.socket, pid: int, received: bytes):
        self.connection, self.pid, self.returncode = connection, pid, None
        self.received = received          # what came after the pid's line: the exit code, if the run ended at once
        if received.endswith(b"\n"):
            self._report()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.connection.setblocking(False)
            try:
                self._read()
            except BlockingIOError:
                pass
            if self.returncode is None:
                self.connection.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(MODULE, timeout)
            self.connection.settimeout(left)
            try:
                self._read()
            except TimeoutError:
                self.connection.settimeout(None)
                raise subprocess.TimeoutExpired(MODULE, timeout) from None
        return self.returncode

    def _read(self) -> None:
        """The child's exit code, once the zygote reported it (then the connection closes)."""
        data = self.connection.recv(4096)
        if not data:        # the zygote is gone: so is its child's report
            raise RuntimeError(f"the test zygote ended before run {self.pid} did")
        self.received += data
        if self.received.endswith(b"\n"):
            self._report()

    def _report(self) -> None:
        self.returncode = json.loads(self.received)["returncode"]
        self.connection.close()


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Zygote:
    """This test process's zygote, started on first use; ``spawn`` forks a run from it."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.path = ""
        self.owner = os.getpid()       # a process forked from this one (a test's) leaves the zygote alone

    def spawn(self, cmd: list[str], env: dict[str, str], stdout: int, stderr: int) -> Forked | None:
        """``cmd`` forked, if it is an `rlcore` command or a Python script (``python bench/x.py ...``) the zygote
        can fork (else None). A script is not checked for SGLang as a run's plugins are: one that imports SGLang
        itself must be started as a process of its own."""
        script = cmd[1] if cmd[:1] == [sys.executable] and len(cmd) > 1 and cmd[1].endswith(".py") else None
        if os.environ.get("RLCORE_TEST_FORK") == "0" or (cmd[:3] != [sys.executable, "-m", MODULE] and not script):
            return None
        self._start()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        request = {"argv": cmd[2:], "script": os.path.abspath(script)} if script else {"argv": cmd[3:]}
        request.update(env=env, cwd=os.getcwd())
        with open(os.devnull) as stdin:
            socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [stdin.fileno(), stdout, stderr])
        reply = b""
        while b"\n" not in reply:
            more = connection.recv(4096)
            if not more:
                raise RuntimeError("the test zygote did not fork the run")
            reply += more
        line, rest = reply.split(b"\n", 1)
        answer = json.loads(line)
        if os.environ.get("RLCORE_TEST_FORK_LOG"):     # each run forked or refused (and why), with its test
            with open(os.environ["RLCORE_TEST_FORK_LOG"], "a") as log:
                log.write(json.dumps({"run": " ".join(cmd[1:3] if script else cmd[3:6]),
                                      "test": os.environ.get("PYTEST_CURRENT_TEST", ""), **answer}) + "\n")
        if "refused" in answer:
            connection.close()
            return None
        return Forked(connection, answer["pid"], rest)

    def stand_ins(self) -> dict[int, int]:
        """The Ray workers forked so far that still run, each with the pid of the process that stands in for it to
        its raylet (tests/ray_worker.py): a forked worker is its zygote's child, not its run's."""
        if self.process is None or self.process.poll() is not None:
            return {}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        with connection, connection.makefile("rb") as replies:
            connection.sendall(json.dumps({"query": "stand_ins"}).encode() + b"\n")
            return {int(fork): stand_in for fork, stand_in in json.loads(replies.readline()).items()}

    def ray_env(self) -> dict[str, str]:
        """What a Run made in the test process itself needs in its environment, as ray.init reads it, for its Ray
        workers to be forked as a forked run's are (``ray_env``)."""
        self._start()
        return ray_env(self.path)

    def _start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.path = os.path.join(tempfile.mkdtemp(prefix="rlcore-zygote-"), "socket")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=STARTING_ENV, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line != "ready\n":
            raise RuntimeError(f"the test zygote failed to start (exit {self.process.wait()})")

    def close(self) -> None:
        if os.getpid() == self.owner and self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=60)
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


if __name__ == "__main__":
    job = serve(sys.argv[1])
    if job is not None:
        run_child(job)
