"""The Python sandbox (rlcore_agent_tools.jail, python_env) contains what a policy's code may do: real subprocesses,
real limits. Every runaway here is also bounded by the test's own code, so a broken sandbox cannot take the machine
down."""
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys

import pytest

from rlcore_agent_tools.jail import Limits, protections, run_python
from rlcore_agent_tools.python_env import PythonEnvironment

FAST = Limits(cpu_seconds=1, wall_seconds=10)

# Forks until the process limit stops it, at most 300 times; every other child leaves the process group (setsid),
# so only a cleanup by uid finds it. The children sleep 60 s at most.
SPAWNER = """
import os, time
print(os.getuid(), flush=True)
started = 0
try:
    while started < 300:
        if os.fork() == 0:
            if started % 2:
                os.setsid()
            time.sleep(60)
            os._exit(0)
        started += 1
finally:
    print(started, flush=True)
"""


def live_processes(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies (read from /proc here, not with the sandbox's own helper)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
        except OSError:
            continue
        if status["Uid"].split()[0] == str(uid) and not status["State"].startswith("Z"):
            found.append(int(name))
    return found


def network_namespace_possible() -> bool:
    """Whether this machine lets rlcore make a network namespace (not root: inside a user namespace), found without
    the sandbox's code."""
    root = os.geteuid() == 0
    if shutil.which("unshare"):
        return subprocess.run(["unshare", "-n"] + ([] if root else ["-U"]) + ["true"]).returncode == 0
    flags = 0x40000000 | (0 if root else 0x10000000)
    code = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_protections_report_what_this_machine_allows():
    found = protections()
    assert found["rlimits"] and found["scratch_dir"]
    root = os.geteuid() == 0
    assert found["network_namespace"] is network_namespace_possible()
    assert found["unprivileged_user"] is root
    assert found["process_limit_per_call"] is (root or found["network_namespace"])
    assert "Python 3." in str(found["python"])
    if not all(v for v in found.values() if isinstance(v, bool)):
        assert found["notes"], "a protection is off: protections() must say why"


def test_runaway_spawner_is_stopped_by_the_process_limit_and_nothing_it_started_survives():
    if not protections()["unprivileged_user"]:
        pytest.skip(f"the code runs as rlcore's uid here, so its leftovers cannot be found by uid: "
                    f"{protections()['notes']}")
    result = run_python(SPAWNER, Limits(processes=32, wall_seconds=20))
    uid, started = (int(line) for line in result.stdout.split())
    assert uid != os.getuid()
    assert started < 32, f"the spawner started {started} processes (its own bound is 300)"
    assert result.outcome == "error" and "process limit 32" in result.reason, result
    assert "BlockingIOError" in result.as_observation()
    assert live_processes(uid) == [], "the spawner's children outlived the call"


def test_infinite_loop_ends_at_the_cpu_time_limit():
    result = run_python("while True:\n    pass", FAST)
    assert (result.outcome, result.reason) == ("killed", "CPU-time limit 1 s"), result
    # before the wall-clock limit: 1 s of CPU can take several seconds of wall on a loaded machine (5.03 s seen)
    assert result.cpu_seconds > 0.9 and result.wall_seconds < FAST.wall_seconds
    assert result.as_observation() == "[killed: CPU-time limit 1 s]"


def test_sleeping_code_and_its_children_end_at_the_wall_clock_limit():
    result = run_python("import os, time\nprint(os.getuid(), flush=True)\nos.fork()\ntime.sleep(60)",
                        Limits(wall_seconds=1))
    assert (result.outcome, result.reason) == ("timeout", "wall-clock limit 1 s"), result
    assert 1 <= result.wall_seconds < 5
    uid = int(result.stdout.split()[0])
    if uid != os.getuid():
        assert live_processes(uid) == []


def test_a_10_gb_allocation_is_a_memory_error_and_the_next_call_runs():
    result = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", Limits(memory_bytes=1 << 30))
    assert result.outcome == "error" and result.reason.startswith("memory limit 1 GiB"), result
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert run_python("print(sum(range(10)))").stdout == "45\n"


def test_a_connect_to_a_local_port_fails():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):     # the port answers this process
            listener.accept()[0].close()
        if not protections()["network_namespace"]:
            pytest.skip(f"no network namespace on this machine: {protections()['notes']}")
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                f"    print('connected')\nexcept OSError as e:\n    print('refused', e)")
        result = run_python(code, FAST)
        assert result.stdout.startswith("refused"), result
        with pytest.raises(BlockingIOError):
            listener.accept()                           # nothing reached the listener


def test_output_exit_codes_truncation_and_syntax_errors():
    ok = run_python("print('hello')\nimport sys\nprint('oops', file=sys.stderr)")
    assert (ok.outcome, ok.exit_code, ok.stdout, ok.stderr) == ("ok", 0, "hello\n", "oops\n")
    assert ok.as_observation() == "hello\noops"
    assert run_python("pass").as_observation() == "(no output)"

    exited = run_python("import sys; sys.exit(3)")
    assert (exited.outcome, exited.exit_code, exited.reason) == ("error", 3, "exit code 3")

    long = run_python("print('HEAD' + 'x' * 20000 + 'TAIL')", Limits(output_bytes=1000))
    assert long.stdout.startswith("HEAD") and long.stdout.endswith("TAIL\n")
    assert "[... 19009 bytes cut ...]" in long.stdout and len(long.stdout) < 1100

    syntax = run_python("def (:\n")
    assert syntax.outcome == "error" and "SyntaxError" in syntax.reason
    assert "SyntaxError" in syntax.as_observation() and syntax.as_observation().endswith("]")


def test_code_runs_in_a_scratch_directory_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("RLCORE_SANDBOX_TEST_SECRET", "kept out")
    code = ("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.environ['HOME'])\n"
            "print(sorted(os.environ))")
    result = run_python(code)
    cwd, home, names = result.stdout.splitlines()
    assert result.outcome == "ok" and cwd == home
    assert not os.path.exists(cwd), "the scratch directory outlived the call"
    assert "RLCORE_SANDBOX_TEST_SECRET" not in names


def test_concurrent_calls_get_their_own_uid():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_python("import os, time; time.sleep(0.5); print(os.getuid())"),
                                range(4)))
    assert all(r.outcome == "ok" for r in results), results
    uids = {int(r.stdout) for r in results}
    assert len(uids) == (4 if protections()["unprivileged_user"] else 1)


def test_limits_refuse_bad_values_and_the_environment_offers_the_python_tool():
    with pytest.raises(ValueError, match="sandbox limit processes=0: must be a positive number"):
        Limits(processes=0)
    env = PythonEnvironment(FAST)
    assert env.reset(question="6*7") is None
    assert env.python("print(6 * 7)") == "42"
