"""`rlcore run` processes forked from a process that has already imported torch, transformers, megatron-core and vLLM.

Each run the tests start is a whole `python -m rlcore.cli ...` process, and before it does anything it imports those
libraries: ~12 s of CPU on a quiet machine, ~50 s of wall beside the rest of the suite on two cores, for runs whose
own work is often less (the quickstart's 2 steps: 23 s exec'd, 7 s forked). A zygote (one per test process) imports
them once and forks a child per run; the child takes the run's argv, environment, working directory and standard
streams, runs ``rlcore.cli`` as ``python -m`` does, and exits as the interpreter does (threads joined, atexit
handlers: Ray's shutdown, temporary files) but for the teardown of every module. rlcore itself is imported fresh in
every child. The zygote imports and computes nothing else (one thread, no torch thread pool, no Ray cluster), so a
fork is what a fresh interpreter would be after the same imports.

A run is forked only where nothing read at import could differ: the same interpreter, an environment equal to the
zygote's but for PYTHONPATH (put on sys.path as the interpreter would), and no SGLang (which patches transformers as
it is imported). Anything else starts a process as before; ``RLCORE_TEST_FORK=0`` starts every run that way.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PRELOAD = ["torch", "transformers", "transformers.models.auto.tokenization_auto",
           "transformers.models.auto.modeling_auto", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
           "vllm", "vllm.entrypoints.llm", "matplotlib.pyplot", "safetensors.torch", "pyarrow.parquet"]
MODULE = "rlcore.cli"
PER_RUN = {"PYTHONPATH", "PYTEST_CURRENT_TEST"}      # what may differ between the zygote's environment and a run's


# --- the zygote's side -------------------------------------------------------------------------------------------
def serve(path: str) -> list[str] | None:
    """Import PRELOAD, then answer spawn requests on the Unix socket ``path`` until stdin closes (the test process
    ended). Returns only in a forked child: the argv it is to run."""
    for name in PRELOAD:
        __import__(name)
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
    while True:
        for key, _ in selector.select(timeout=1):
            if key.data == "parent":
                for pid in children:
                    _kill_group(pid)
                return None
            if key.data == "ended":
                ended.recv(4096)
                continue
            if key.data == "accept":
                connection, _ = listener.accept()
                selector.register(connection, selectors.EVENT_READ, "request")
                continue
            connection = key.fileobj
            selector.unregister(connection)
            request, fds = _receive(connection)
            if request is None:
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
                return _become(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = children.pop(pid)
                try:
                    connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                connection.close()


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


def _become(request: dict, fds: list[int]) -> list[str]:
    """In the forked child: the run's session, streams, directory, environment and sys.path."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *[p for p in sys.path[1:] if p not in extra]]
    import importlib
    import random

    import numpy

    importlib.invalidate_caches()
    random.seed()                 # seeded afresh, as a new interpreter's are: not the zygote's copies
    numpy.random.seed()
    return request["argv"]


def run_child(argv: list[str]) -> None:
    """``python -m rlcore.cli argv...`` in this process, as the interpreter runs a module, and its exit as the
    interpreter's up to the teardown of every module, skipped: with the zygote's thousands of modules it took ~2 s
    and does nothing a run's outcome shows (what must happen at exit is registered with atexit)."""
    import atexit
    import runpy
    import threading

    sys.argv = [MODULE, *argv]
    code = 0
    try:
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

    def kill(self) -> None:
        _kill_group(self.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Zygote:
    """This test process's zygote, started on first use; ``spawn`` forks a run from it."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.path = ""
        self.owner = os.getpid()       # a process forked from this one (a test's) leaves the zygote alone

    def forkable(self, cmd: list[str], env: dict[str, str]) -> bool:
        if os.environ.get("RLCORE_TEST_FORK") == "0" or cmd[:3] != [sys.executable, "-m", MODULE]:
            return False
        if "sglang" in next((a for a in cmd if a.startswith("--plugins=")), ""):
            return False
        base = self.env or zygote_env()
        return all(env.get(k) == base.get(k) for k in set(env) | set(base) if k not in PER_RUN)

    def spawn(self, cmd: list[str], env: dict[str, str], stdout: int, stderr: int) -> Forked:
        self._start()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        request = {"argv": cmd[3:], "env": env, "cwd": os.getcwd()}
        with open(os.devnull) as stdin:
            socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [stdin.fileno(), stdout, stderr])
        reply = b""
        while b"\n" not in reply:
            more = connection.recv(4096)
            if not more:
                raise RuntimeError("the test zygote did not fork the run")
            reply += more
        line, rest = reply.split(b"\n", 1)
        return Forked(connection, json.loads(line)["pid"], rest)

    def _start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.path = os.path.join(tempfile.mkdtemp(prefix="rlcore-zygote-"), "socket")
        self.env = zygote_env()
        self.process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=self.env, text=True)
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


def zygote_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


if __name__ == "__main__":
    job = serve(sys.argv[1])
    if job is not None:
        run_child(job)
