"""Running a rank script under torchrun, for the multi-process tests."""
import subprocess

from safetensors.torch import load_file

from rlcore.launch import torchrun


def run_ranks(script: str, directory, procs: int, out, *args) -> dict:
    """``script`` on ``procs`` processes (torchrun, gloo) with ``out`` and ``args`` as its arguments; returns the
    tensors rank 0 saved to ``out`` (safetensors)."""
    path = directory / "rank.py"
    path.write_text(script)
    result = subprocess.run([*torchrun(procs), str(path), str(out), *map(str, args)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(out)
