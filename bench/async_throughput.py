"""Asynchronous against colocated RL at equal core count, on the quickstart, a long-tailed and a slow-world workload.

    python bench/async_throughput.py [--steps 40] [--eval-every 5] [--threshold 0.65] [--warmup 3]
                                     [--workloads quickstart,long-tailed,slow-world] [--staleness 0,1,2]
                                     [--partial false,true] [--keep DIR] [--smoke] [key=value ...]

Every run is a real ``rlcore run`` of the quickstart (``--plugins=qwen3,grpo,vllm quickstart``, its warm start
cached), one after another: *colocated* with ``trainer.world_size=2`` (two Ray workers, each a Megatron
data-parallel shard and a vLLM engine), then *async* with ``trainer.mode=async trainer.world_size=1
rollout.world_size=1`` (the trainer in the driver process, one rollout worker) for each ``rollout.max_staleness``
and ``rollout.partial`` asked for: two busy processes either way. The *long-tailed* workload is the same run with the
``long_tail`` agent of bench/long_tail (put on PYTHONPATH here): after the answer each episode's engine continues the
sequence to a drawn length, 90 % around a median of 8 tokens and 10 % 10x that, which both sides pay for (generated
by the engine, in the trainer's forward and backward) while only the answer is trained on and scored, so its
colocated run learns exactly as the quickstart's. Its model context is 96 positions (the quickstart's: 64), a warm
start of its own, cached after the first run. The *slow-world* workload is the quickstart with the ``slow_tool``
agent of the same plugin: after its answer each episode waits on a remote service's reply, real wall time (0.1-0.3 s,
1 s for 10 % of the calls), as agentic RL waits on tools, sandboxes and judges; colocated, the trainer waits with it.

Per run, from its metrics.jsonl, over the steps after the first ``--warmup`` ones, leaving out the two after each
evaluation (during an evaluation the async producer goes on filling its buffer, and the colocated engine gets the
weights it then skips syncing): steps/s (steps over the sum of their ``time/step``, the loop's time for a step:
rollout or waiting for groups, reward, update, weight sync; not evaluation); response tokens/s (the trained
batches' response tokens, tails included, over the same time); the trainer's idle fraction (async:
``async/trainer_idle_frac``; colocated: the step's share spent generating, ``time/rollout``); the rollout side's
idle fraction (async), the mean seconds of each phase of a step (the old-logprob pass runs only where a batch
gets several updates), the engine pause of a push, the mean staleness; and the first evaluation (every ``--eval-every``
steps) at held-out accuracy >= ``--threshold``, as its step and the sum of ``time/step`` until then. Last line:
``async speedup <x> quickstart, <y> long-tailed, <z> slow-world``: the best async setting's steps/s over the
colocated run's. Goals: >= 1.4x on the quickstart and >= 1.6x long-tailed (issue 26), >= 1.5x slow-world (issue 39),
reaching the threshold no later.
``--smoke`` (tests/integration/test_bench_smoke.py): the long-tailed and slow-world workloads (so the plugin's
agents too) unless ``--workloads`` is given, async at staleness 0 without partial, and the first workload colocated on
one worker too (the comparison; the others' speedups print as n/a), 2 steps of 4 prompts x 2 samples (evaluated on
8 held-out prompts at step 2, the first left out), from the model as built (no warm start; SMOKE, its cache with the
runs).
The runs' folder is removed after a run that ends well, unless it is ``--keep``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
LONG_TAIL = os.path.join(HERE, "long_tail")
WORKLOADS = {
    "quickstart": {"plugins": "qwen3,grpo,vllm", "overrides": [], "path": []},
    "long-tailed": {"plugins": "qwen3,grpo,vllm,long_tail", "path": [LONG_TAIL],
                    "overrides": ["rollout.agent=long_tail", "task.reward=answer_before_tail",
                                  "model.tiny.max_position_embeddings=96"]},
    "slow-world": {"plugins": "qwen3,grpo,vllm,long_tail", "path": [LONG_TAIL],
                   "overrides": ["rollout.agent=slow_tool"]},
}
GOALS = {"quickstart": 1.4, "long-tailed": 1.6, "slow-world": 1.5}
COLOCATED = ["trainer.world_size=2"]
AFTER_EVAL = 2          # steps left out after each evaluation
PHASES = ("rollout", "wait", "train", "logprobs", "sync")   # time/<phase>: generating (colocated) or waiting for
                                                            # groups (async), the update, its logprob pass, the push
SMOKE = ["warm_start.steps=0", "warm_start.target_accuracy=0", "trainer.prompts_per_step=4", "rollout.n=2",
         "task.options.eval_size=8"]


def async_overrides(staleness: int, partial: bool) -> list[str]:
    return ["trainer.mode=async", "trainer.world_size=1", "rollout.world_size=1",
            f"rollout.max_staleness={staleness}", f"rollout.partial={str(partial).lower()}"]


def run(workload: str, mode: list[str], run_dir: str, args) -> tuple[list[dict], dict, int]:
    """One ``rlcore run`` to its end; its per-step metrics, summary, and samples per prompt (rollout.n)."""
    spec = WORKLOADS[workload]
    command = [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={spec['plugins']}", "quickstart",
               f"trainer.steps={args.steps}", f"trainer.eval_every={args.eval_every}", "run.progress=false",
               "trainer.export_hf=false", f"run.dir={run_dir}", *spec["overrides"], *mode, *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([*spec["path"], os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
    print(f"  {' '.join(command[3:])}", flush=True)
    with open(os.path.join(run_dir + ".log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        with open(run_dir + ".log") as log:
            tail = log.read()[-3000:]
        sys.exit(f"{tail}\nasync_throughput: the {workload} run {' '.join(mode)} failed (exit {done.returncode}); "
                 f"its log: {run_dir}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        n = yaml.safe_load(f)["rollout"]["n"]
    return history, summary, n


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def measure(history: list[dict], summary: dict, n: int, args) -> dict:
    """What one run's metrics say (see the module docstring)."""
    evaluated = [h["step"] for h in history if h.get("eval/accuracy") is not None]
    skipped = {e + k for e in evaluated for k in range(1, AFTER_EVAL + 1)}
    timed = [h for h in history if h["step"] > args.warmup and h["step"] not in skipped]
    seconds = sum(h["time/step"] for h in timed)
    tokens = sum(h["response/length_mean"] * h["sampling/groups_kept"] * n for h in timed)
    is_async = any("async/staleness_max" in h for h in history)
    idle = [h["async/trainer_idle_frac"] for h in timed if "async/trainer_idle_frac" in h] if is_async \
        else [h["time/rollout"] / h["time/step"] for h in timed]
    reached = None
    if summary["eval_accuracy_before"] >= args.threshold:
        reached = (0, 0.0)
    else:
        elapsed = 0.0
        for h in history:
            elapsed += h["time/step"]
            if (h.get("eval/accuracy") or 0.0) >= args.threshold:
                reached = (h["step"], elapsed)
                break
    return {"steps_per_s": len(timed) / seconds, "steps": len(timed),
            "tokens_per_s": tokens / seconds,
            "trainer_idle": mean(idle),
            "rollout_idle": mean([h["async/rollout_idle_frac"] for h in timed if "async/rollout_idle_frac" in h]),
            **{f"{phase}_s": mean([h.get(f"time/{phase}", 0.0) for h in timed]) for phase in PHASES},
            "other_s": mean([h["time/step"] - sum(h.get(f"time/{phase}", 0.0) for phase in PHASES) for h in timed]),
            "pause_s": mean([h["sync/pause_seconds"] for h in timed if "sync/pause_seconds" in h]),
            "staleness": mean([h["async/staleness_mean"] for h in timed if "async/staleness_mean" in h]),
            "stale_dropped": sum(h.get("async/stale_dropped", 0.0) for h in history),
            "reached": reached,
            "accuracy": (summary["eval_accuracy_before"], summary["eval_accuracy_after"])}


def shown(value: float, spec: str) -> str:
    """``value`` formatted, or '-' where a mode has no such number (NaN)."""
    return "-" if value != value else format(value, spec)


def threshold_text(reached: tuple[int, float] | None, steps: int) -> str:
    return f"not in {steps} steps" if reached is None else f"step {reached[0]} ({reached[1]:.1f} s)"


def report(workload: str, results: dict[str, dict], goal: float, args) -> float:
    """The workload's table and its best async setting against colocated; returns that speedup."""
    colocated = results["colocated"]
    print(f"{workload}: {'mode':<18} {'steps/s':>7} {'x coloc':>7} {'tokens/s':>8} {'trainer idle':>12} "
          f"{'rollout idle':>12} {'rollout s':>9} {'wait s':>6} {'train s':>7} {'logprobs s':>10} {'sync s':>6} "
          f"{'pause s':>7} {'other s':>7} {'staleness':>9} {'dropped':>7} {'accuracy':>11}  "
          f"threshold {args.threshold}")
    for name, r in results.items():
        print(f"{'':<{len(workload) + 1}} {name:<18} {r['steps_per_s']:>7.2f} "
              f"{r['steps_per_s'] / colocated['steps_per_s']:>7.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['trainer_idle']:>12.1%} {shown(r['rollout_idle'], '.1%'):>12} {r['rollout_s']:>9.3f} "
              f"{r['wait_s']:>6.3f} {r['train_s']:>7.3f} {r['logprobs_s']:>10.3f} {r['sync_s']:>6.3f} "
              f"{shown(r['pause_s'], '.3f'):>7} {r['other_s']:>7.3f} {shown(r['staleness'], '.2f'):>9} "
              f"{r['stale_dropped']:>7.0f} {r['accuracy'][0]:>5.3f}>{r['accuracy'][1]:<5.3f}  "
              f"{threshold_text(r['reached'], args.steps)}")
    name, best = max(((n, r) for n, r in results.items() if n != "colocated"), key=lambda item: item[1]["steps_per_s"])
    speedup = best["steps_per_s"] / colocated["steps_per_s"]
    ours, theirs = best["reached"], colocated["reached"]
    timing = ("no later" if ours is not None and (theirs is None or ours[1] <= theirs[1]) else "later")
    print(f"{workload}: best async setting {name}: {speedup:.2f}x the colocated steps/s (goal >= {goal}x); "
          f"threshold {args.threshold}: colocated {threshold_text(theirs, args.steps)}, "
          f"async {threshold_text(ours, args.steps)}: {timing}", flush=True)
    return speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.65, help="held-out accuracy to reach")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    parser.add_argument("--workloads", help="default: quickstart,long-tailed,slow-world (--smoke: long-tailed,"
                                            "slow-world)")
    parser.add_argument("--staleness", help="rollout.max_staleness values of the async runs (default: 0,1,2; "
                                            "--smoke: 0)")
    parser.add_argument("--partial", help="rollout.partial values of the async runs (default: false,true; "
                                          "--smoke: false)")
    parser.add_argument("--keep", help="keep the runs (run dirs and logs) here")
    parser.add_argument("--smoke", action="store_true", help="2 small steps, no warm start: a check that it runs")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    smoke = dict(workloads="long-tailed,slow-world", staleness="0", partial="false") if args.smoke else \
        dict(workloads="quickstart,long-tailed,slow-world", staleness="0,1,2", partial="false,true")
    for key, default in smoke.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            sys.exit(f"async_throughput: --workloads names {w!r}; choose from {', '.join(WORKLOADS)}")
    settings = [(int(s), p == "true") for s in args.staleness.split(",") for p in args.partial.split(",")]

    root = args.keep or tempfile.mkdtemp(prefix="async-throughput-")
    os.makedirs(root, exist_ok=True)
    if args.smoke:
        args.steps, args.eval_every, args.warmup = 2, 2, 1
        args.overrides = [*SMOKE, f"warm_start.cache_dir={os.path.join(root, 'warm_start')}", *args.overrides]
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; runs in {root}", flush=True)
    speedups = {}
    for workload in workloads:
        colocated = ["trainer.world_size=1"] if args.smoke else COLOCATED
        modes = {"colocated": colocated, **{f"async S={s}{' partial' if p else ''}": async_overrides(s, p)
                                            for s, p in settings}}
        if args.smoke and workload != workloads[0]:      # its agent's run; one comparison is enough for a smoke
            del modes["colocated"]
        results = {}
        for name, mode in modes.items():
            run_dir = os.path.join(root, f"{workload}-{name.replace(' ', '-').replace('=', '')}")
            started, load = time.perf_counter(), os.getloadavg()[0]
            history, summary, n = run(workload, mode, run_dir, args)
            results[name] = measure(history, summary, n, args)
            print(f"    {name}: {results[name]['steps_per_s']:.2f} steps/s, run {time.perf_counter() - started:.0f} s, "
                  f"load average {load:.2f} before it, {os.getloadavg()[0]:.2f} after", flush=True)
        if "colocated" in results:
            speedups[workload] = report(workload, results, GOALS[workload], args)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    speedup = {w: f"{speedups[w]:.2f}" if w in speedups else "n/a" for w in WORKLOADS}
    if not args.keep:
        shutil.rmtree(root)
    print(f"async speedup {speedup['quickstart']} quickstart, {speedup['long-tailed']} long-tailed, "
          f"{speedup['slow-world']} slow-world")


if __name__ == "__main__":
    main()
