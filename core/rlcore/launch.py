"""Starting local rank processes: a rendezvous port of their own, and the torchrun command line.

Runs and tests share a machine (the test suite runs on two pytest workers), so a rendezvous never uses a fixed port:
two launches would meet in each other's store. The port is picked here and bound later by another process (torchrun's
agent, rank 0's TCPStore), so it comes from below the kernel's ephemeral range: the kernel hands ports from that range
to every socket that binds port 0 or connects out (Ray's and gloo's many loopback connections), and one of those could
take it in between. A port in use now is skipped. The pick uses the OS's randomness, which a test's random.seed cannot
make two processes repeat."""
from __future__ import annotations

import random
import socket
import sys

LOWEST = 20000      # below: well-known and registered services
_pick = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768    # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that nothing uses now, for a rendezvous that a process started next binds."""
    candidates = range(LOWEST, _ephemeral_low())
    for port in _pick.sample(candidates, min(64, len(candidates))):
        if _bindable(port):
            return port
    with socket.socket() as s:      # none free below the ephemeral range: the kernel's pick
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun(procs: int) -> list[str]:
    """The command that starts ``procs`` local ranks under torchrun on a free rendezvous port; the script and its
    arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}"]
