"""Running Python a policy wrote: one subprocess per call, contained, and the ``python`` tool built on it.

What is contained, and how (each call, in a child that sets it up and then execs ``python -I -`` on the code):

- CPU time (``RLIMIT_CPU``, per process), address space (``RLIMIT_AS``: a 10 GB allocation is a MemoryError),
  file size (``RLIMIT_FSIZE``, also bounding what it prints), open files, no core dumps.
- Processes: ``RLIMIT_NPROC`` counts a *user's* processes and root ignores it, so when rlcore runs as root each call
  runs as a fresh unprivileged uid of its own (leased from a reserved range under a file lock, so concurrent calls,
  threads or processes, never share one): the limit is per call, a fork bomb meets it, and nothing it started
  survives the call (every process of that uid is killed afterwards, those that left the process group too). Not
  root: the code runs as rlcore's uid in a user namespace of its own, where the kernel counts the limit per
  namespace (seen on Linux 6.18), so it is per call too; but a process that leaves the process group survives the
  call. Without a user namespace the limit is rlcore's process count plus ``Limits.processes``.
- Wall clock: the whole process group is killed at ``Limits.wall_seconds``.
- Network: its own network namespace (``unshare(CLONE_NEWNET)``: as root, or inside an unprivileged user namespace
  where the kernel allows one), holding only a loopback that is down: no connection anywhere, 127.0.0.1 and abstract
  unix sockets of the host included.
- Files: the working directory (also HOME and TMPDIR) is a fresh scratch directory, removed afterwards; the code
  sees only a minimal environment (``-I``: no PYTHON* variables, no user site-packages).

The code runs on rlcore's interpreter if the sandbox uid can run it, else on the system's python3 without rlcore's
packages (as on these machines, where the venv's Python lives under /root, which only root may enter);
``protections()["python"]`` says which. A call takes ~30 ms for ``print(1)`` here.

Not contained: what unix permissions allow the sandbox uid (reading world-readable files, writing world-writable
places such as /tmp, which are not cleaned; a unix socket file that accepts anyone), and disk use beyond the
file-size limit per file. Where a protection is unavailable (not root, no CAP_SYS_ADMIN) the code runs with the
others; ``protections()`` says which are active and logs them once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator

from rlcore.specs import EnvironmentSpec

log = logging.getLogger(__name__)

# uids leased to sandboxed code when rlcore is root: one per call in flight, held by an flock on a file per uid.
UID_BASE = 1_900_000_000
UID_COUNT = 4096
UID_LOCK_DIR = "/tmp/rlcore-sandbox-uids"
OPEN_FILES = 256
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000

# Runs as rlcore's user in the child (a fresh single-threaded interpreter, unlike a preexec_fn in a threaded
# process): namespaces, rlimits, then the unprivileged uid, then exec of the sandboxed interpreter (or, for
# cleanup, kill(-1): every process of that uid). A failure is written to the error pipe, which a successful exec
# closes.
_SETUP = r"""
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
step = "start"
try:
    if cfg["unshare"]:
        step = "unshare(%#x)" % cfg["unshare"]
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(cfg["unshare"]) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
    for name, soft, hard in cfg["rlimits"]:
        step = "setrlimit " + name
        resource.setrlimit(getattr(resource, name), (soft, hard))
    uid = cfg["uid"]
    if uid is not None:
        step = "dropping to uid %d" % uid
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if cfg["kill"]:
        step = "kill(-1)"
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif cfg["argv"]:
        step = "exec " + cfg["argv"][0]
        os.set_inheritable(cfg["error_fd"], False)
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    os._exit(0)
except BaseException as e:
    os.write(cfg["error_fd"], ("%s: %s" % (step, e)).encode())
    os._exit(125)
"""


@dataclass(frozen=True)
class Limits:
    """What one call may use. ``cpu_seconds`` is per process, rounded up to whole seconds; ``wall_seconds`` bounds the call (every process);
    ``memory_bytes`` is address space per process; ``processes`` counts threads too (Linux counts tasks);
    ``output_bytes`` is what is kept of stdout and of stderr each (the middle is cut); ``file_bytes`` bounds every
    file the code writes, its stdout and stderr included (a write past it fails)."""
    cpu_seconds: float = 5
    memory_bytes: int = 1 << 30
    processes: int = 32
    wall_seconds: float = 10
    output_bytes: int = 8 << 10
    file_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {f.name}={value!r}: must be a positive number")


@dataclass
class Result:
    """What one call did. ``outcome``: "ok" (exit status 0), "error" (another exit status: an exception, a limit the
    code met as an exception such as MemoryError), "timeout" (the wall clock) or "killed" (a signal: the CPU-time or
    file-size limit); ``reason``: one line naming the limit or the exit status. ``exit_code`` is negative for a
    signal, as in ``subprocess``."""
    outcome: str
    reason: str
    exit_code: int
    stdout: str
    stderr: str
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0

    def as_observation(self) -> str:
        """The text a model reads: what the code printed (stdout, then stderr), then ``[outcome: reason]`` unless it
        ended fine."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text.strip()]
        if self.outcome != "ok":
            parts.append(f"[{self.outcome}: {self.reason}]")
        return "\n".join(parts) or "(no output)"


@dataclass(frozen=True)
class _Setup:
    """What this machine allows, found once (``_setup``). ``namespaces``: the unshare flags each call gets."""
    namespaces: int
    drop_uid: bool
    python: str
    version: str
    notes: tuple[str, ...]

    @property
    def process_limit_per_call(self) -> bool:
        return self.drop_uid or bool(self.namespaces & CLONE_NEWUSER)


_setup_lock = threading.Lock()
_setup_found: _Setup | None = None


def protections() -> dict[str, bool | str]:
    """Which protections calls get on this machine: rlimits, process_limit_per_call (else the limit is shared with
    rlcore's processes), network_namespace, unprivileged_user (a uid of its own, whose processes are all killed after
    the call), scratch_dir; python: the interpreter that runs the code; notes: what is off and why, and which
    interpreter runs the code if not rlcore's ("" if nothing to say)."""
    return _protections(_setup())


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run ``code`` as a Python program in a contained subprocess and wait for it (at most ``limits.wall_seconds``
    and the cleanup). Thread-safe: each call has its own scratch directory, uid (as root) and process group."""
    setup = _setup()
    started = time.monotonic()
    with _uid(setup.drop_uid) as uid, _workdir(uid) as work:
        with open(os.path.join(work, "program.py"), "w+b") as program:
            program.write(code.encode("utf-8", "surrogatepass"))
            program.seek(0)
            with open(os.path.join(work, "stdout"), "wb") as out, open(os.path.join(work, "stderr"), "wb") as err:
                scratch = os.path.join(work, "scratch")
                env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
                       "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                child, error_pipe = _spawn(setup.namespaces, _rlimits(limits, setup), uid,
                                           [setup.python, "-I", "-"], env, stdin=program, stdout=out, stderr=err,
                                           cwd=scratch)
        try:
            timed_out, cpu = _wait(child, limits.wall_seconds)
        finally:
            if uid is not None:
                _kill_all(uid)
            failure = _read_all(error_pipe)
        stdout = _kept(os.path.join(work, "stdout"), limits.output_bytes)
        stderr = _kept(os.path.join(work, "stderr"), limits.output_bytes)
    exit_code = child.returncode
    if failure:
        log.warning("python sandbox could not start the code: %s", failure)
        outcome, reason = "error", f"sandbox setup failed: {failure}"
    else:
        outcome, reason = _outcome(exit_code, timed_out, cpu, stderr, limits)
    return Result(outcome, reason, exit_code, stdout, stderr, cpu, time.monotonic() - started)


class PythonEnvironment:
    """An environment with one tool, ``python``: the model's code runs in the sandbox (``run_python``), a fresh
    subprocess per call, so nothing carries over between calls."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()

    def reset(self, **row: Any) -> str | None:
        """Nothing to prepare: each call starts from a fresh interpreter."""
        return None

    def python(self, code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: a complete Python program; print what you want to see (stdout and stderr are returned).
        """
        return run_python(code, self.limits).as_observation()


# --- the child --------------------------------------------------------------------------------------------------

def _spawn(namespaces: int, rlimits: list[tuple[str, int, int]], uid: int | None, argv: list[str] | None,
           env: dict[str, str], kill: bool = False, **popen: Any) -> tuple[subprocess.Popen, int]:
    """Start the setup child (its own session, so its process group is the call's); returns it and the read end of
    its error pipe."""
    read_end, write_end = os.pipe()
    config = {"unshare": namespaces, "rlimits": rlimits, "uid": uid, "argv": argv, "env": env,
              "kill": kill, "error_fd": write_end}
    try:
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SETUP, json.dumps(config)], pass_fds=(write_end,),
                                 start_new_session=True, env={}, **popen)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return child, read_end


def _rlimits(limits: Limits, setup: _Setup) -> list[tuple[str, int, int]]:
    """(name, soft, hard) of each rlimit a call gets."""
    cpu = math.ceil(limits.cpu_seconds)
    processes = limits.processes if setup.process_limit_per_call else _tasks_of(os.getuid()) + limits.processes
    return [("RLIMIT_CPU", cpu, cpu + 1),     # SIGXCPU at the soft limit; SIGKILL a second later if it is ignored
            ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
            ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
            ("RLIMIT_NPROC", processes, processes),
            ("RLIMIT_NOFILE", OPEN_FILES, OPEN_FILES),
            ("RLIMIT_CORE", 0, 0)]


def _wait(child: subprocess.Popen, timeout: float) -> tuple[bool, float]:
    """Wait for ``child`` to exit, at most ``timeout`` seconds; then kill its process group (still reserved by the
    unreaped child, so the id cannot name another group) and reap it. Returns (timed out, its CPU seconds)."""
    pidfd = os.pidfd_open(child.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        timed_out = not poller.poll(timeout * 1000)
    finally:
        os.close(pidfd)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return timed_out, usage.ru_utime + usage.ru_stime


def _outcome(exit_code: int, timed_out: bool, cpu: float, stderr: str, limits: Limits) -> tuple[str, str]:
    """(outcome, reason) of a call: the limit it met, or its exit status. A limit the code meets as an exception is
    read from the exception's line (the last of stderr)."""
    if timed_out:
        return "timeout", f"wall-clock limit {limits.wall_seconds:g} s"
    cpu_limit = math.ceil(limits.cpu_seconds)
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu >= cpu_limit):
        return "killed", f"CPU-time limit {cpu_limit} s"
    if exit_code == -signal.SIGXFSZ:
        return "killed", f"file-size limit {_size(limits.file_bytes)}"
    if exit_code < 0:
        return "killed", f"killed by {signal.Signals(-exit_code).name}"
    if exit_code == 0:
        return "ok", "exit code 0"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if "[Errno 27] File too large" in last:              # Python ignores SIGXFSZ: the write fails instead
        return "error", f"file-size limit {_size(limits.file_bytes)} ({last})"
    if last.startswith("MemoryError"):
        return "error", f"memory limit {_size(limits.memory_bytes)} ({last})"
    if last.startswith("BlockingIOError: [Errno 11]") or "can't start new thread" in last:
        return "error", f"process limit {limits.processes} ({last})"
    return "error", f"exit code {exit_code}" + (f" ({last[:200]})" if last else "")


# --- uid, scratch directory, cleanup ----------------------------------------------------------------------------

@contextlib.contextmanager
def _uid(drop: bool) -> Iterator[int | None]:
    """A uid no other call holds and no process has (None when calls run as rlcore's own uid). The flock is per open
    file, so it holds between threads of one process as between processes, and a crashed holder's lock goes with it.
    A uid whose killed processes are still zombies (init reaps orphans when it will: every ~2 s here) is skipped, so
    each call gets its whole process limit."""
    if not drop:
        yield None
        return
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        fd = os.open(os.path.join(UID_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if _pids(uid):          # zombies not reaped yet count against the process limit; a crashed holder's
                _kill_all(uid)      # call may have left live ones
                continue
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"python sandbox: all {UID_COUNT} sandbox uids ({UID_BASE}+) are in use; "
                       f"run fewer calls at once")


@contextlib.contextmanager
def _workdir(uid: int | None) -> Iterator[str]:
    """A private directory (program, stdout, stderr: rlcore's) holding ``scratch``, the code's own; removed after."""
    work = tempfile.mkdtemp(prefix="rlcore-sandbox-")
    try:
        scratch = os.path.join(work, "scratch")
        os.mkdir(scratch, 0o700)
        if uid is not None:
            os.chmod(work, 0o711)       # the sandbox uid may pass through to its scratch, not list or read the rest
            os.chown(scratch, uid, uid)
        yield work
    finally:
        try:
            shutil.rmtree(work)
        except OSError as e:
            log.warning("python sandbox: could not remove %s: %s", work, e)


def _kill_all(uid: int) -> None:
    """Kill every process of ``uid``, also those that left the call's process group: kill(-1) from a process of that
    uid reaches exactly them, whatever their pids (no race with pid reuse). Returns when none is alive; their
    zombies may wait a while for init to reap them (``_uid`` skips the uid until then)."""
    for _ in range(100):
        if all(zombie for zombie in _pids(uid).values()):
            return
        child, error_pipe = _spawn(0, [], uid, None, {}, kill=True)
        child.wait()
        failure = _read_all(error_pipe)
        if failure:
            raise RuntimeError(f"python sandbox: cannot kill the processes of uid {uid}: {failure}")
        time.sleep(0.005)
    log.warning("python sandbox: processes of uid %d still alive after 100 kills", uid)


def _pids(uid: int) -> dict[int, bool]:
    """The processes whose real uid is ``uid``: pid -> whether it is a zombie."""
    return {pid: status.get("State", "").startswith("Z") for pid, status in _proc_status()
            if status.get("Uid", "").split()[:1] == [str(uid)]}


def _tasks_of(uid: int) -> int:
    """Tasks (threads) of ``uid``: what RLIMIT_NPROC counts."""
    return sum(int(status.get("Threads", "1")) for _, status in _proc_status()
               if status.get("Uid", "").split()[:1] == [str(uid)])


def _proc_status() -> Iterator[tuple[int, dict[str, str]]]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    yield int(name), dict(line.split(":\t", 1) for line in f if ":\t" in line)
            except OSError:             # gone meanwhile
                continue


def _read_all(fd: int) -> str:
    """Everything in the pipe ``fd`` (its writers have exited or exec'd), closing it."""
    with open(fd, "rb") as f:
        return f.read().decode("utf-8", "replace").strip()


def _kept(path: str, keep: int) -> str:
    """The file's text, its middle cut to keep ``keep`` bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= keep:
            data = f.read()
        else:
            head = f.read(keep // 2)
            f.seek(size - (keep - keep // 2))
            data = head + f"\n[... {size - keep} bytes cut ...]\n".encode() + f.read()
    return data.decode("utf-8", "replace")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


# --- what this machine allows -----------------------------------------------------------------------------------

def _setup() -> _Setup:
    """The machine's protections, probed by the first call (logged once, in one line)."""
    global _setup_found
    with _setup_lock:
        if _setup_found is None:
            _setup_found = _probe()
            found = _protections(_setup_found)
            log.info("python sandbox: %s; python %s%s",
                     ", ".join(f"{k} {'on' if v else 'OFF'}" for k, v in found.items() if isinstance(v, bool)),
                     found["python"], f" ({found['notes']})" if found["notes"] else "")
        return _setup_found


def _protections(setup: _Setup) -> dict[str, bool | str]:
    return {"rlimits": True, "process_limit_per_call": setup.process_limit_per_call,
            "network_namespace": bool(setup.namespaces & CLONE_NEWNET), "unprivileged_user": setup.drop_uid,
            "scratch_dir": True, "python": f"{setup.python} (Python {setup.version})", "notes": "; ".join(setup.notes)}


def _probe() -> _Setup:
    """Try each protection in a child: the namespaces, then (as root) an interpreter the sandbox uid can run
    (rlcore's own may live where only root can read, as in a venv over a Python under /root)."""
    root = os.geteuid() == 0
    namespaces = CLONE_NEWNET if root else CLONE_NEWNET | CLONE_NEWUSER
    child, error_pipe = _spawn(namespaces, [], None, None, {})
    child.wait()
    failure = _read_all(error_pipe)
    notes = [f"no network namespace ({failure}): the code can reach the network"] if failure else []
    namespaces = 0 if failure else namespaces
    if not root:
        notes.append(f"rlcore is not root: the code runs as its uid {os.getuid()} (a process that leaves the "
                     f"process group outlives the call)"
                     + ("" if namespaces else ", sharing its process limit"))
        return _Setup(namespaces, False, sys.executable, sys.version.split()[0], tuple(notes))
    refused: list[str] = []
    with _uid(True) as uid:
        for python in _interpreters():
            child, error_pipe = _spawn(0, [], uid, [python, "-I", "-c", "import sys; print(sys.version.split()[0])"],
                                       {}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            version = child.communicate(timeout=60)[0].decode().strip()
            failure = _read_all(error_pipe) or (f"exit code {child.returncode}" if child.returncode else "")
            if not failure:
                if refused:
                    notes.append(f"the sandbox user cannot run {refused[0]}: the code runs on {python}")
                return _Setup(namespaces, True, python, version, tuple(notes))
            refused.append(f"{python} ({failure})")
    notes.append(f"no interpreter the sandbox user can run ({'; '.join(refused)}): the code runs as root, without a "
                 f"process limit")
    return _Setup(namespaces, False, sys.executable, sys.version.split()[0], tuple(notes))


def _interpreters() -> list[str]:
    """rlcore's interpreter, then the system's of the same version, then any python3 on the default PATH."""
    found = [sys.executable] + [shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
                                for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3")]
    return list(dict.fromkeys(p for p in found if p))


def _make_python_environment(options: dict) -> PythonEnvironment:
    from rlcore.config import bind_plugin_section

    return PythonEnvironment(bind_plugin_section("agent.options", options, Limits))


PYTHON = EnvironmentSpec("python", _make_python_environment,
                         "a python(code) tool, run in the sandbox; agent.options are its Limits")
