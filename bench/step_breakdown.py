"""Time RL steps at the quickstart's scale and split them into phases.

    python bench/step_breakdown.py [--steps 40] [--warmup 5] [key=value ...]

Prints the median seconds of rollout / weight sync / logprobs / train / whole step, and the weight sync against
its floor measured in the same run: a plain ``copy_`` of the same tensors (same names, shapes, bytes) into
preallocated buffers. Target on the 2-core CPU machine: median step < 0.4 s.
"""
from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from rlcore.config import load_config
    from rlcore.controller import Trainer
    from rlcore.plugins import load_plugins

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("quickstart", [f"run.dir={run_dir}", "run.progress=false", "trainer.loggers=[]",
                                         *args.overrides])
        trainer = Trainer(cfg, load_plugins(["qwen3", "grpo", "vllm"]))
        try:
            trainer.setup()
            trainer.evaluate(0)  # the engine's first generate pays one-off warm-up costs
            rows = []
            for step in range(1, args.steps + args.warmup + 1):
                start = time.perf_counter()
                m = trainer.step(step)
                m["time/step"] = time.perf_counter() - start
                if step > args.warmup:
                    rows.append(m)
            parameters = trainer.workers.call("num_parameters")[0]
            copy_s, copy_bytes = plain_copy_seconds(trainer.workers.workers[0].actor)
        finally:
            trainer.close()

    def med(key):
        return statistics.median(r[key] for r in rows)

    sync_bytes = int(rows[-1]["sync/bytes"])
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"quickstart scale: {cfg.trainer.prompts_per_step} prompts x {cfg.rollout.n} samples, "
          f"{parameters:,} parameters, {len(rows)} timed steps (after {args.warmup} warm-up), "
          f"torch threads {torch.get_num_threads()}, VLLM_CPU_OMP_THREADS_BIND={bind}")
    print(f"{'phase':<10} {'median s':>9}")
    for phase in ("rollout", "sync", "logprobs", "train", "reward", "step"):
        print(f"{phase:<10} {med('time/' + phase):>9.4f}")
    sync = med("time/sync")
    print(f"weight sync: {sync_bytes / 1e6:.2f} MB in {sync:.4f} s; plain copy of the same {copy_bytes / 1e6:.2f} MB: "
          f"{copy_s:.5f} s; sync / copy = {sync / copy_s:.1f}x")
    print(f"median step {med('time/step'):.3f} s (target < 0.4 s): {'MET' if med('time/step') < 0.4 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
