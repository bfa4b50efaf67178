"""The process jail: Python a policy wrote, run in one contained subprocess per call (``run_python``; the ``python``
environment on it: ``python_env``; the setup child, uids and the machine's protections: ``jail_setup``).

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
import logging
import math
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass, fields

from rlcore_agent_tools.jail_setup import (OPEN_FILES, Setup, kill_all, lease_uid, machine_setup, protections_of,
                                           read_all, spawn, tasks_of, workdir)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one call may use. ``cpu_seconds`` is per process, rounded up to whole seconds; ``wall_seconds`` bounds
    the call (every process); ``memory_bytes`` is address space per process; ``processes`` counts threads too (Linux
    counts tasks); ``output_bytes`` is what is kept of stdout and of stderr each (the middle is cut); ``file_bytes``
    bounds every file the code writes, its stdout and stderr included (a write past it fails)."""
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


def protections() -> dict[str, bool | str]:
    """Which protections calls get on this machine: rlimits, process_limit_per_call (else the limit is shared with
    rlcore's processes), network_namespace, unprivileged_user (a uid of its own, whose processes are all killed after
    the call), scratch_dir; python: the interpreter that runs the code; notes: what is off and why, and which
    interpreter runs the code if not rlcore's ("" if nothing to say)."""
    return protections_of(machine_setup())


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run ``code`` as a Python program in a contained subprocess and wait for it (at most ``limits.wall_seconds``
    and the cleanup). Thread-safe: each call has its own scratch directory, uid (as root) and process group."""
    setup = machine_setup()
    started = time.monotonic()
    with lease_uid(setup.drop_uid) as uid, workdir(uid) as work:
        with open(os.path.join(work, "program.py"), "w+b") as program:
            program.write(code.encode("utf-8", "surrogatepass"))
            program.seek(0)
            with open(os.path.join(work, "stdout"), "wb") as out, open(os.path.join(work, "stderr"), "wb") as err:
                scratch = os.path.join(work, "scratch")
                env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
                       "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                child, error_pipe = spawn(setup.namespaces, _rlimits(limits, setup), uid,
                                          [setup.python, "-I", "-"], env, stdin=program, stdout=out, stderr=err,
                                          cwd=scratch)
        try:
            timed_out, cpu = _wait(child, limits.wall_seconds)
        finally:
            if uid is not None:
                kill_all(uid)
            failure = read_all(error_pipe)
        stdout = _kept(os.path.join(work, "stdout"), limits.output_bytes)
        stderr = _kept(os.path.join(work, "stderr"), limits.output_bytes)
    exit_code = child.returncode
    if failure:
        log.warning("python sandbox could not start the code: %s", failure)
        outcome, reason = "error", f"sandbox setup failed: {failure}"
    else:
        outcome, reason = _outcome(exit_code, timed_out, cpu, stderr, limits)
    return Result(outcome, reason, exit_code, stdout, stderr, cpu, time.monotonic() - started)


# --- the call ---------------------------------------------------------------------------------------------------

def _rlimits(limits: Limits, setup: Setup) -> list[tuple[str, int, int]]:
    """(name, soft, hard) of each rlimit a call gets."""
    cpu = math.ceil(limits.cpu_seconds)
    processes = limits.processes if setup.process_limit_per_call else tasks_of(os.getuid()) + limits.processes
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
