"""Running a rank script under torchrun, for the multi-process tests."""
import json
import subprocess

from safetensors.torch import load_file

from rlcore.launch import torchrun


def _torchrun(script: str, directory, procs: int, *args) -> None:
    path = directory / "rank.py"
    path.write_text(script)
    result = subprocess.run([*torchrun(procs), str(path), *map(str, args)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def run_ranks(script: str, directory, procs: int, out, *args) -> dict:
    """``script`` on ``procs`` processes (torchrun, gloo) with ``out`` and ``args`` as its arguments; returns the
    tensors rank 0 saved to ``out`` (safetensors)."""
    _torchrun(script, directory, procs, out, *args)
    return load_file(out)


def run_rank_jobs(script: str, directory, procs: int, jobs: list[dict]) -> list[dict]:
    """``script`` on ``procs`` processes, once for many jobs: it gets a JSON file of ``jobs``, each given an ``out``
    path here, and saves each job's tensors there from rank 0; returns them in the jobs' order. One start instead of
    one per job: a process start that imports Megatron costs far more than a tiny model's step."""
    jobs = [{**job, "out": str(directory / f"job{i}.safetensors")} for i, job in enumerate(jobs)]
    (directory / "jobs.json").write_text(json.dumps(jobs))
    _torchrun(script, directory, procs, directory / "jobs.json")
    return [load_file(job["out"]) for job in jobs]
