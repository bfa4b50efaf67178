"""Async mode losing a rollout worker: the quickstart with two rollout workers, undisturbed against one of them
SIGKILLed while it trains (issue 42's benchmark).

    python bench/rollout_healing.py [--steps 300] [--kill-at 10 [30 ...]] [--seeds 0 [1 2 ...]] [--cache DIR]
                                    [--timeout 900] [--keep DIR] [--smoke] [key=value ...]

Every run is a real ``rlcore run --plugins=qwen3,grpo,vllm quickstart trainer.mode=async rollout.world_size=2
rollout.max_staleness=1`` (the trainer in the driver, two rollout workers; evaluated before and after only), each in
its own run dir, started as a user starts it, one after another; the warm start comes from the default cache or
``--cache``. For each seed (``run.seed``): the *undisturbed* run, then the *disturbed* one, in which a rollout worker
(a Ray actor titled ``ray::RolloutWorker``, chosen at random among those alive, a replacement still starting
included) is SIGKILLed as soon as each step of ``--kill-at`` is logged. The run heals it (rlcore.rollout.roster):
its groups start again on the other worker, a replacement starts and serves after the next weight push. A run still
going after ``--timeout`` seconds (a hang: a healthy one takes 2-3 minutes here) is stopped and fails the benchmark.

Per run, from its metrics.jsonl and summary.json: steps/s (steps over the sum of their ``time/step``: waiting for
groups, the update, the push; not evaluation) over the steps after the first kill point and over the whole run;
after each kill, the seconds until the first step that logs ``rollout/workers_alive`` 2 again (after one that logged
fewer: the time the line appeared, watched from here; a replacement serves from the push at the end of the step
before; a kill that comes before the last one's replacement serves runs to the same step: both are back then),
replacements started (``rollout/restarts``), requests started again (``rollout/requests_reissued``), and held-out
greedy accuracy before and after. With several ``--seeds``, the held-out gain (after - before) of each pair
with the mean and the sample standard deviation over seeds: issue 42 asks the disturbed runs' gain to be within
noise of the undisturbed ones' (3 seeds, two kills a run: ``--seeds 0 1 2 --kill-at 10 30``).
Last line: ``rollout_healing: steps/s after losing 1 of 2 rollout workers at step <k>: <x> vs <y> undisturbed
(ratio <z>); replacement serving after <s> s`` (means over seeds; the slowest replacement; or ``replacement not
serving by the end``), then, with several seeds,
``; held-out gain <a> vs <b> undisturbed (<n> seeds)``.
``--smoke`` (tests/integration/test_bench_smoke.py): the disturbed run only (the undisturbed one is the same code
path without the kill; its steps/s and the ratio print as n/a), one kill after step 2 of 6 steps of 4 prompts x 2
samples, from the model as built (no warm start; its cache with the runs), stopped after 300 s; the replacement may
not serve before the run ends.
The runs' folder is removed after a benchmark that ends well, unless it is ``--keep``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ASYNC = ["trainer.mode=async", "rollout.world_size=2", "rollout.max_staleness=1", "trainer.eval_every=0"]
SMOKE = ["warm_start.steps=0", "warm_start.target_accuracy=0", "trainer.prompts_per_step=4", "rollout.n=2",
         "task.options.eval_size=8"]
POLL_S = 0.05      # how often the watcher reads metrics.jsonl: the resolution of the replacement's time


def rollout_workers(driver: psutil.Process) -> list[psutil.Process]:
    """The run's rollout workers: Ray names their processes after the class; what they fork (not Ray's children)
    is left out."""
    found = []
    for process in driver.children(recursive=True):
        try:
            if process.cmdline()[0].startswith("ray::RolloutWorker") and \
                    not process.parent().cmdline()[0].startswith("ray::"):
                found.append(process)
        except (psutil.NoSuchProcess, IndexError):
            pass
    return found


def end(process: subprocess.Popen, driver: psutil.Process) -> None:
    """Stop a run that hangs or is interrupted as a user would: SIGTERM to the driver, which stops after the step under
    way or, past trainer.stop_grace_s (120 s), ends its process tree itself (its process group would take Ray's GCS
    down under it); then SIGKILL for whatever of the tree is left."""
    try:
        tree = driver.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for left in tree:
        try:
            left.kill()
        except psutil.NoSuchProcess:
            pass


def run(run_dir: str, seed: int, kill_at: list[int], args) -> dict:
    """One ``rlcore run`` to its end, a rollout worker SIGKILLed once each step of ``kill_at`` is logged; its
    per-step metrics, the time each line appeared, the kills (time, steps logged then) and its summary."""
    command = [sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart", *ASYNC,
               f"run.seed={seed}", "run.progress=false", "trainer.export_hf=false", f"run.dir={run_dir}",
               *([f"trainer.steps={args.steps}"] if args.steps else []),
               *([f"warm_start.cache_dir={args.cache}"] if args.cache else []), *args.overrides]
    note = f"  (SIGKILL after steps {', '.join(map(str, kill_at))})" if kill_at else ""
    print(f"  {' '.join(command[3:])}{note}", flush=True)
    metrics, history, appeared, kills, pending = os.path.join(run_dir, "metrics.jsonl"), [], [], [], list(kill_at)
    chosen, killed = random.Random(seed), set()
    started = time.perf_counter()
    with open(run_dir + ".log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        driver, offset, ended = psutil.Process(process.pid), 0, False
        try:
            while not ended:
                ended = process.poll() is not None      # one more read after the end
                if time.perf_counter() - started > args.timeout:
                    break
                if os.path.exists(metrics):
                    with open(metrics) as f:
                        f.seek(offset)
                        text = f.read()
                    complete = text[:text.rfind("\n") + 1]
                    offset += len(complete.encode())
                    now = time.perf_counter()
                    for line in complete.splitlines():
                        history.append(json.loads(line))
                        appeared.append(now)
                if pending and len(history) >= pending[0] and not ended:
                    victims = [p for p in rollout_workers(driver) if p.pid not in killed]
                    if victims:
                        victim = chosen.choice(victims)
                        victim.send_signal(signal.SIGKILL)
                        killed.add(victim.pid)
                        kills.append((time.perf_counter(), len(history)))
                        pending.pop(0)
                time.sleep(POLL_S)
        finally:
            timed_out = process.poll() is None
            if timed_out:
                end(process, driver)
    if timed_out or process.returncode != 0 or pending:
        with open(run_dir + ".log") as log:
            tail = log.read()[-3000:]
        what = (f"hung: stopped after {args.timeout:.0f} s at step {len(history)}" if timed_out else
                f"failed (exit {process.returncode})" if process.returncode else
                f"ended before the kill after step {pending[0]}")
        sys.exit(f"{tail}\nrollout_healing: the run {run_dir} {what}; its log: {run_dir}.log")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"history": history, "appeared": appeared, "kills": kills, "summary": summary,
            "wall_s": time.perf_counter() - started}


def steps_per_s(history: list[dict]) -> float:
    return len(history) / sum(h["time/step"] for h in history)


def serving_after(result: dict) -> list[float | None]:
    """For each kill: seconds from it to the first line logging 2 serving workers after one that logged fewer (the
    loss seen); None if none did by the end."""
    alive = [h["rollout/workers_alive"] for h in result["history"]]
    seconds = []
    for killed_at, logged in result["kills"]:
        lost = next((i for i in range(logged, len(alive)) if alive[i] < 2), None)
        back = None if lost is None else next((i for i in range(lost, len(alive)) if alive[i] >= 2), None)
        seconds.append(None if back is None else result["appeared"][back] - killed_at)
    return seconds


def measure(result: dict, after: int) -> dict:
    """What one run's metrics say (see the module docstring); ``after``: the first kill point."""
    history, summary = result["history"], result["summary"]
    return {"after_steps_per_s": steps_per_s([h for h in history if h["step"] > after]),
            "steps_per_s": steps_per_s(history), "steps": len(history),
            "serving_s": serving_after(result),
            "restarts": sum(h["rollout/restarts"] for h in history),
            "reissued": sum(h["rollout/requests_reissued"] for h in history),
            "before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"],
            "gain": summary["eval_accuracy_after"] - summary["eval_accuracy_before"], "wall_s": result["wall_s"]}


def seconds_text(seconds: list[float | None]) -> str:
    return ", ".join("never" if s is None else f"{s:.1f}" for s in seconds) or "-"


def spread(values: list[float]) -> str:
    """Mean and sample standard deviation (of two values or more)."""
    return f"{statistics.mean(values):+.3f} +- {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="trainer.steps (default: the quickstart's, 300)")
    parser.add_argument("--kill-at", type=int, nargs="+", default=[10],
                        help="SIGKILL a rollout worker once each of these steps is logged")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each pair of runs")
    parser.add_argument("--cache", help="warm_start.cache_dir (default: the run's default cache)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take (--smoke: 300)")
    parser.add_argument("--keep", help="keep the runs (run dirs and logs) here")
    parser.add_argument("--smoke", action="store_true", help="6 small steps, no warm start: a check that it runs")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="rollout-healing-")
    os.makedirs(root, exist_ok=True)
    if args.smoke:
        args.steps, args.kill_at, args.seeds, args.timeout = 6, [2], args.seeds[:1], 300
        args.cache = os.path.join(root, "warm_start")
        args.overrides = [*SMOKE, *args.overrides]
    kill_at = sorted(args.kill_at)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; runs in {root}", flush=True)
    results: dict[int, dict[str, dict]] = {}
    for seed in args.seeds:
        results[seed] = {}
        for name, kills in [("disturbed", kill_at)] if args.smoke else [("undisturbed", []), ("disturbed", kill_at)]:
            load = os.getloadavg()[0]
            results[seed][name] = r = measure(run(os.path.join(root, f"seed{seed}-{name}"), seed, kills, args),
                                              kill_at[0])
            print(f"    {name}: {r['after_steps_per_s']:.2f} steps/s after step {kill_at[0]}, run {r['wall_s']:.0f} s, "
                  f"load average {load:.2f} before it, {os.getloadavg()[0]:.2f} after", flush=True)

    print(f"{'seed':>4} {'run':<11} {'steps':>5} {f'steps/s > {kill_at[0]}':>13} {'steps/s all':>11} "
          f"{'back to 2 serving, s':>21} {'restarts':>8} {'reissued':>8} {'held-out':>11} {'gain':>6} {'wall s':>6}")
    for seed, pair in results.items():
        for name, r in pair.items():
            print(f"{seed:>4} {name:<11} {r['steps']:>5} {r['after_steps_per_s']:>13.2f} {r['steps_per_s']:>11.2f} "
                  f"{seconds_text(r['serving_s']):>21} {r['restarts']:>8.0f} {r['reissued']:>8.0f} "
                  f"{r['before']:>5.3f}>{r['after']:<5.3f} {r['gain']:>+6.3f} {r['wall_s']:>6.0f}")
    undisturbed = [pair["undisturbed"] for pair in results.values() if "undisturbed" in pair]
    disturbed = [pair["disturbed"] for pair in results.values()]
    if len(results) > 1:
        gains = [[r["gain"] for r in runs] for runs in (undisturbed, disturbed)]
        print(f"held-out gain per seed ({', '.join(map(str, results))}): undisturbed "
              f"{' '.join(f'{g:+.3f}' for g in gains[0])} = {spread(gains[0])}; disturbed "
              f"{' '.join(f'{g:+.3f}' for g in gains[1])} = {spread(gains[1])}; disturbed - undisturbed "
              f"{spread([d - u for u, d in zip(*gains)])}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if not args.keep:
        shutil.rmtree(root)
    ours = statistics.mean(r["after_steps_per_s"] for r in disturbed)
    theirs = statistics.mean(r["after_steps_per_s"] for r in undisturbed) if undisturbed else None
    versus = f"{theirs:.2f} undisturbed (ratio {ours / theirs:.2f})" if theirs else "n/a undisturbed (ratio n/a)"
    serving = [s for r in disturbed for s in r["serving_s"]]
    replacement = ("replacement not serving by the end" if None in serving else
                   f"replacement serving after {max(serving):.1f} s")
    gain = (f"; held-out gain {statistics.mean(r['gain'] for r in disturbed):+.3f} vs "
            f"{statistics.mean(r['gain'] for r in undisturbed):+.3f} undisturbed ({len(results)} seeds)"
            if len(results) > 1 else "")
    print(f"rollout_healing: steps/s after losing 1 of 2 rollout workers at step{'s' if len(kill_at) > 1 else ''} "
          f"{', '.join(map(str, kill_at))}: {ours:.2f} vs {versus}; "
          f"{replacement}{gain}")


if __name__ == "__main__":
    main()
