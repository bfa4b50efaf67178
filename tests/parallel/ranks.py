"""Running a rank script under torchrun, for the multi-process tests."""
import socket
import subprocess
import sys

from safetensors.torch import load_file


def free_port() -> int:
    """A port nothing listens on now, for torchrun's rendezvous (tests running side by side need different ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, directory, procs: int, port: int, out, *args) -> dict:
    """``script`` on ``procs`` processes (torchrun, gloo) with ``out`` and ``args`` as its arguments; returns the
    tensors rank 0 saved to ``out`` (safetensors)."""
    path = directory / "rank.py"
    path.write_text(script)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}"]
    result = subprocess.run([*launcher, str(path), str(out), *map(str, args)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(out)
