"""Running a rank script under torchrun, for the multi-process tests."""
import json
import textwrap

from safetensors.torch import load_file


def _torchrun(script: str, directory, procs: int, *args) -> None:
    from runs import torchrun      # here: rank scripts import this module, without tests/ on their path

    path = directory / "rank.py"
    path.write_text(script)
    result = torchrun(procs, path, *args)
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


# The end of a rank script for run_rank_jobs whose jobs each name a function the script defines ("run") and its
# arguments ("args"); rank 0 saves the tensors it returns. Between jobs only Megatron's groups are torn down: the next
# job's init_parallel builds them at its layout and reseeds, so a job computes what it would in a fresh process.
RUN_JOBS = textwrap.dedent("""
    def run_jobs():
        import json, sys
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from safetensors.torch import save_file
        from rlcore.megatron.parallel import shutdown_parallel
        for job in json.load(open(sys.argv[1])):
            result = globals()[job["run"]](*job["args"])
            if dist.get_rank() == 0:
                save_file({name: t.contiguous() for name, t in result.items()}, job["out"])
            del result
            mpu.destroy_model_parallel()
        shutdown_parallel()

    run_jobs()
""")


def run_jobs_by_world(script: str, directory, jobs: dict) -> dict:
    """``jobs``: key -> (processes, job) for run_rank_jobs. The jobs of one world size run in one torchrun, the world
    sizes in the order they first appear (a job may read what an earlier world's jobs wrote); returns key -> the
    job's tensors."""
    results = {}
    for procs in dict.fromkeys(procs for procs, _ in jobs.values()):
        keys = [key for key, (p, _) in jobs.items() if p == procs]
        (directory / f"world{procs}").mkdir()
        results.update(zip(keys, run_rank_jobs(script, directory / f"world{procs}", procs, [jobs[k][1] for k in keys])))
    return results
