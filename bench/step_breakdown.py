"""Time RL steps at the quickstart's scale and split them into phases, for each rollout backend in one run.

    python bench/step_breakdown.py [--backend vllm,sglang] [--steps 40] [--warmup 5] [--smoke] [key=value ...]

Prints, per backend, the median seconds of rollout / weight sync / logprobs / train / whole step, each backend's
phases against the first's, and the weight sync against its floor measured in the same run: a plain ``copy_`` of
the same tensors (same names, shapes, bytes) into preallocated buffers. Target on the 2-core CPU machine: median
step < 0.4 s. Last line: the last backend's ``... sync / copy = <x>x; median step <s> s (target < 0.4 s): MET``
(or ``NOT MET``).
``--smoke`` (tests/integration/test_bench_smoke.py): vLLM unless ``--backend`` is given, 2 steps after 1 warm-up step of
4 prompts x 2 samples, from the model as built (no warm start; SMOKE, its cache in a temporary folder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def plain_copy_seconds(actor, repeats: int = 5) -> tuple[float, int]:
    """Best-of-N time to copy every HF tensor the sync sends into preallocated destination buffers."""
    tensors = [t.contiguous() for _, t in actor.hf_weights()]
    dest = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for d, t in zip(dest, tensors):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
    return best, sum(t.numel() * t.element_size() for t in tensors)


PHASES = ("rollout", "sync", "logprobs", "train", "reward", "step")
SMOKE = ["warm_start.steps=0", "warm_start.target_accuracy=0", "trainer.prompts_per_step=4", "rollout.n=2"]


def measure(backend: str, args) -> dict:
    """Median seconds per phase over the timed steps of one run with ``backend`` generating."""
    from rlcore.config import load_config
    from rlcore.evaluation import evaluate
    from rlcore.loop import step as rl_step
    from rlcore.plugins import load_plugins
    from rlcore.run import Run

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("quickstart", [f"run.dir={run_dir}", "run.progress=false", "trainer.loggers=[]",
                                         f"rollout.backend={backend}", *args.overrides])
        run = Run(cfg, load_plugins(["qwen3", "grpo", backend]))
        try:
            run.setup()
            run.source.push_weights(run.learner.weights(), run.learner.version, 0)
            evaluate(run.source, run.task, cfg, 0)  # the engine's first generate pays one-off warm-up costs
            rows = []
            for step in range(1, args.steps + args.warmup + 1):
                start = time.perf_counter()
                m = rl_step(run.source, run.learner, run.cadence, step)
                m["time/step"] = time.perf_counter() - start
                if step > args.warmup:
                    rows.append(m)
            parameters = run.workers.num_parameters()
            copy_s, copy_bytes = plain_copy_seconds(run.workers.workers[0].actor)
        finally:
            run.close()
    result = {phase: statistics.median(r["time/" + phase] for r in rows) for phase in PHASES}
    result.update(copy_s=copy_s, copy_bytes=copy_bytes, sync_bytes=int(rows[-1]["sync/bytes"]),
                  parameters=parameters, steps=len(rows), prompts=cfg.trainer.prompts_per_step, n=cfg.rollout.n)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="rollout backends, comma-separated, in one run (default: vllm,sglang; "
                                          "--smoke: vllm)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    parser.add_argument("--smoke", action="store_true", help="2 small steps, no warm start: a check that it runs")
    parser.add_argument("--measure-to", help=argparse.SUPPRESS)     # one backend's run, in its own process
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.measure_to:
        with open(args.measure_to, "w") as f:
            json.dump(measure(args.backend, args), f)
        return 0
    backends = (args.backend or ("vllm" if args.smoke else "vllm,sglang")).split(",")
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        if args.smoke:
            args.steps, args.warmup = 2, 1
            args.overrides = [*SMOKE, f"warm_start.cache_dir={cache}", *args.overrides]
        for b in backends:    # each in a fresh process: Megatron's parallel state is per process
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, __file__, "--backend", b, "--steps", str(args.steps), "--warmup",
                                str(args.warmup), "--measure-to", out.name, *args.overrides], check=True)
                results[b] = json.load(open(out.name))
    first = results[backends[0]]
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"quickstart scale: {first['prompts']} prompts x {first['n']} samples, {first['parameters']:,} parameters, "
          f"{first['steps']} timed steps (after {args.warmup} warm-up), torch threads {torch.get_num_threads()}, "
          f"VLLM_CPU_OMP_THREADS_BIND={bind}")
    print(f"{'phase':<10}" + "".join(f" {b + ' s':>10}" for b in backends)
          + "".join(f" {b + '/' + backends[0]:>14}" for b in backends[1:]))
    for phase in PHASES:
        print(f"{phase:<10}" + "".join(f" {results[b][phase]:>10.4f}" for b in backends)
              + "".join(f" {results[b][phase] / max(first[phase], 1e-9):>14.2f}" for b in backends[1:]))
    for b in backends:
        r = results[b]
        print(f"{b}: weight sync {r['sync_bytes'] / 1e6:.2f} MB in {r['sync']:.4f} s; plain copy of the same "
              f"{r['copy_bytes'] / 1e6:.2f} MB: {r['copy_s']:.5f} s; sync / copy = {r['sync'] / r['copy_s']:.1f}x; "
              f"median step {r['step']:.3f} s (target < 0.4 s): {'MET' if r['step'] < 0.4 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
