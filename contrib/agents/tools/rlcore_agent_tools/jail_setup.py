"""Setting up the process jail (``jail``) on this machine: the setup child that enters the namespaces, sets the
rlimits, drops to a leased uid and execs the code; the uids leased to calls (as root), their scratch directories and
the cleanup that kills every process of a call's uid; and which protections this machine allows, probed once."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

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
class Setup:
    """What this machine allows, found once (``machine_setup``). ``namespaces``: the unshare flags each call gets."""
    namespaces: int
    drop_uid: bool
    python: str
    version: str
    notes: tuple[str, ...]

    @property
    def process_limit_per_call(self) -> bool:
        return self.drop_uid or bool(self.namespaces & CLONE_NEWUSER)


_setup_lock = threading.Lock()
_setup_found: Setup | None = None


# --- the child --------------------------------------------------------------------------------------------------

def spawn(namespaces: int, rlimits: list[tuple[str, int, int]], uid: int | None, argv: list[str] | None,
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


# --- uid, scratch directory, cleanup ----------------------------------------------------------------------------

@contextlib.contextmanager
def lease_uid(drop: bool) -> Iterator[int | None]:
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
                kill_all(uid)       # call may have left live ones
                continue
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"python sandbox: all {UID_COUNT} sandbox uids ({UID_BASE}+) are in use; "
                       f"run fewer calls at once")


@contextlib.contextmanager
def workdir(uid: int | None) -> Iterator[str]:
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


def kill_all(uid: int) -> None:
    """Kill every process of ``uid``, also those that left the call's process group: kill(-1) from a process of that
    uid reaches exactly them, whatever their pids (no race with pid reuse). Returns when none is alive; their
    zombies may wait a while for init to reap them (``lease_uid`` skips the uid until then)."""
    for _ in range(100):
        if all(zombie for zombie in _pids(uid).values()):
            return
        child, error_pipe = spawn(0, [], uid, None, {}, kill=True)
        child.wait()
        failure = read_all(error_pipe)
        if failure:
            raise RuntimeError(f"python sandbox: cannot kill the processes of uid {uid}: {failure}")
        time.sleep(0.005)
    log.warning("python sandbox: processes of uid %d still alive after 100 kills", uid)


def _pids(uid: int) -> dict[int, bool]:
    """The processes whose real uid is ``uid``: pid -> whether it is a zombie."""
    return {pid: status.get("State", "").startswith("Z") for pid, status in _proc_status()
            if status.get("Uid", "").split()[:1] == [str(uid)]}


def tasks_of(uid: int) -> int:
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


def read_all(fd: int) -> str:
    """Everything in the pipe ``fd`` (its writers have exited or exec'd), closing it."""
    with open(fd, "rb") as f:
        return f.read().decode("utf-8", "replace").strip()


# --- what this machine allows -----------------------------------------------------------------------------------

def machine_setup() -> Setup:
    """The machine's protections, probed by the first call (logged once, in one line)."""
    global _setup_found
    with _setup_lock:
        if _setup_found is None:
            _setup_found = _probe()
            found = protections_of(_setup_found)
            log.info("python sandbox: %s; python %s%s",
                     ", ".join(f"{k} {'on' if v else 'OFF'}" for k, v in found.items() if isinstance(v, bool)),
                     found["python"], f" ({found['notes']})" if found["notes"] else "")
        return _setup_found


def protections_of(setup: Setup) -> dict[str, bool | str]:
    return {"rlimits": True, "process_limit_per_call": setup.process_limit_per_call,
            "network_namespace": bool(setup.namespaces & CLONE_NEWNET), "unprivileged_user": setup.drop_uid,
            "scratch_dir": True, "python": f"{setup.python} (Python {setup.version})", "notes": "; ".join(setup.notes)}


def _probe() -> Setup:
    """Try each protection in a child: the namespaces, then (as root) an interpreter the sandbox uid can run
    (rlcore's own may live where only root can read, as in a venv over a Python under /root)."""
    root = os.geteuid() == 0
    namespaces = CLONE_NEWNET if root else CLONE_NEWNET | CLONE_NEWUSER
    child, error_pipe = spawn(namespaces, [], None, None, {})
    child.wait()
    failure = read_all(error_pipe)
    notes = [f"no network namespace ({failure}): the code can reach the network"] if failure else []
    namespaces = 0 if failure else namespaces
    if not root:
        notes.append(f"rlcore is not root: the code runs as its uid {os.getuid()} (a process that leaves the "
                     f"process group outlives the call)"
                     + ("" if namespaces else ", sharing its process limit"))
        return Setup(namespaces, False, sys.executable, sys.version.split()[0], tuple(notes))
    refused: list[str] = []
    with lease_uid(True) as uid:
        for python in _interpreters():
            child, error_pipe = spawn(0, [], uid, [python, "-I", "-c", "import sys; print(sys.version.split()[0])"],
                                      {}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            version = child.communicate(timeout=60)[0].decode().strip()
            failure = read_all(error_pipe) or (f"exit code {child.returncode}" if child.returncode else "")
            if not failure:
                if refused:
                    notes.append(f"the sandbox user cannot run {refused[0]}: the code runs on {python}")
                return Setup(namespaces, True, python, version, tuple(notes))
            refused.append(f"{python} ({failure})")
    notes.append(f"no interpreter the sandbox user can run ({'; '.join(refused)}): the code runs as root, without a "
                 f"process limit")
    return Setup(namespaces, False, sys.executable, sys.version.split()[0], tuple(notes))


def _interpreters() -> list[str]:
    """rlcore's interpreter, then the system's of the same version, then any python3 on the default PATH."""
    found = [sys.executable] + [shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
                                for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3")]
    return list(dict.fromkeys(p for p in found if p))
