"""The Python of a forked run's Ray workers (Ray's ``py_executable``, set by tests/zygote.py): Ray execs
``<this> default_worker.py args...`` where it would exec ``python default_worker.py args...``. This asks the test
zygote to run the worker script in a fork of its own, then stands in for that fork to the raylet that started it:
it forwards SIGTERM and SIGINT, and exits as the fork did. The zygote kills the fork if this process is killed. Where
the zygote is gone or refuses (an environment that differs where it matters), it execs Python as Ray would have.

Run with ``python -S``: it imports the standard library only, so it starts in milliseconds."""
import json
import os
import signal
import socket
import sys


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(os.environ["RLCORE_TEST_ZYGOTE"])
        request = {"script": os.path.abspath(script), "argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                   "stand_in": True}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = _lines(connection)
        reply = next(replies)
    except (KeyError, OSError, ValueError):
        reply = {"refused": "no zygote"}
    if os.environ.get("RLCORE_TEST_FORK_LOG"):       # where to note what was forked and what was not, and why
        with open(os.environ["RLCORE_TEST_FORK_LOG"], "a") as log:
            log.write(json.dumps(reply) + "\n")
    if "refused" in reply:
        os.execv(sys.executable, [sys.executable, script, *args])
    pid = reply["pid"]
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda received, _: os.kill(pid, received))
    code = next(replies)["returncode"]
    if code < 0:                       # killed by a signal: so is this process
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _lines(connection: socket.socket):
    """The zygote's replies, one JSON object a line: the fork's pid, then its exit code."""
    data = b""
    while True:
        while b"\n" not in data:
            more = connection.recv(4096)
            if not more:
                raise OSError("the zygote closed the connection")
            data += more
        line, data = data.split(b"\n", 1)
        yield json.loads(line)


if __name__ == "__main__":
    main()
