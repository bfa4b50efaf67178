"""Async mode heals and resizes its rollout side (real vLLM in Ray rollout workers, real megatron-core trainer): rollout
workers SIGKILLed at random while the run trains are replaced, their groups start again on the others, and the run
finishes every step; `rlcore scale` adds a worker to a running job and removes one. Throughout, each prompt is
trained once at most and every draw before the last ones whole (a ledger of the prompt ids each step trained,
written by a plugin's ``rlcore_rollout_end`` hook), the staleness bound holds, the engine check holds on every worker
(new ones included) and nothing is left running after the run."""
import json
import os
import random
import re
import signal
import sys
from pathlib import Path

import pytest

from runs import (ENV, async_quickstart, install_distribution, logged, ray_workers, run_cli, run_processes, shm_left,
                  shm_segments, start, wait_until)
from test_async_failures import outliving, title

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.parallel]

LEDGER_PLUGIN = '''"""Writes the prompt ids of each step's trained batch (one line per step) to LEDGER."""
import json

from rlcore.hookspecs import hookimpl

LEDGER = {ledger!r}


@hookimpl
def rlcore_rollout_end(step, batch):
    with open(LEDGER, "a") as f:
        f.write(json.dumps({{"step": step, "prompts": [m["prompt_id"] for m in batch.meta]}}) + "\\n")
'''
BATCH, N = 16, 8          # the quickstart's trainer.prompts_per_step and rollout.n


def ledger_env(tmp_path) -> tuple[dict, Path]:
    """The environment of a run with the ledger plugin, and the ledger it writes."""
    site, ledger = tmp_path / "site", tmp_path / "ledger.jsonl"
    site.mkdir()
    install_distribution(site, "rlcore-ledger", "ledger_plugin", LEDGER_PLUGIN.format(ledger=str(ledger)),
                         entry="ledger")
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}, ledger


def two_workers(tmp_path, cache, steps: int, env: dict, stderr):
    """An async run with two rollout workers, the engine checked after every push, and the ledger plugin."""
    return start(async_quickstart(tmp_path / "run", cache, "rollout.world_size=2", "trainer.check_logprobs_every=1",
                                  plugins="qwen3,grpo,vllm,ledger", steps=steps), stderr=stderr, env=env)


def ledger_run(tmp_path, cache, kills_after: list[int], steps: int, seed: int):
    """An async run with two rollout workers and the ledger plugin; a rollout worker SIGKILLed once each of
    ``kills_after`` steps is logged: the first while it takes a weight push (the push goes on without it), the others
    at random (serving, or a replacement still starting). Returns the run dir, its exit code, stderr, the ledger, the
    victims' pids and the run's processes seen last."""
    env, ledger = ledger_env(tmp_path)
    run_dir, chosen, victims = tmp_path / "run", random.Random(seed), []
    with open(tmp_path / "stderr", "w") as stderr:
        run = two_workers(tmp_path, cache, steps, env, stderr)
        try:
            for kill, after in enumerate(kills_after):
                doing = "ray::RolloutWorker.receive_weights" if kill == 0 else "ray::RolloutWorker"
                workers = wait_until(run, lambda: len(logged(run_dir)) >= after
                                     and [p for p in ray_workers(run.pid, "RolloutWorker")
                                          if p.pid not in victims and title(p).startswith(doing)], timeout=600)
                victim = chosen.choice(workers)
                victims.append(victim.pid)
                victim.send_signal(signal.SIGKILL)
            seen = run_processes(run.pid)
            code = run.wait(timeout=600)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    return run_dir, code, (tmp_path / "stderr").read_text(), read_ledger(ledger), victims, seen


def read_ledger(ledger: Path) -> list[dict]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def check_ledger(lines: list[dict], steps: int) -> None:
    """Each step trained a full batch; no prompt twice; every draw below the newest one trained only in part was
    trained whole (a group lost with its worker was started again, not dropped)."""
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    groups = []
    for line in lines:
        ids = line["prompts"]
        assert len(ids) == BATCH * N and all(ids[i] == ids[i - i % N] for i in range(len(ids))), line
        groups += ids[::N]
    assert len(groups) == len(set(groups)), "a prompt was trained twice"
    by_draw: dict[int, set[int]] = {}
    for prompt in groups:
        draw, index = map(int, prompt.split("/"))
        by_draw.setdefault(draw, set()).add(index)
    whole = [d for d in sorted(by_draw) if len(by_draw[d]) == BATCH]
    assert whole == list(range(1, len(whole) + 1)), sorted((d, len(i)) for d, i in by_draw.items())
    assert all(d > len(whole) for d in by_draw if d not in whole)
    assert len(whole) >= steps - 2, "more than the staleness window of draws trained in part"


@pytest.mark.parametrize("seed", [0])
def test_rollout_workers_killed_at_random_are_replaced_and_the_run_trains_each_prompt_once(tmp_path, warm_start_cache,
                                                                                          seed):
    steps = 60
    shm_before = shm_segments()
    run_dir, code, err, lines, victims, seen = ledger_run(tmp_path, warm_start_cache, [3, 8, 20], steps, seed)
    assert code == 0, err[-4000:]
    history = logged(run_dir)
    check_ledger(lines, steps)
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert sum(h["rollout/restarts"] for h in history) == len(victims), [h["rollout/restarts"] for h in history]
    assert err.count("a replacement is starting") == len(victims), err[-4000:]
    assert max(h["rollout/workers_alive"] for h in history[-5:]) >= 1
    # a replacement served: the engine check after each push held on every worker, new ones included
    assert re.search(r"rollout worker \d serving \(weights v\d+\)", err), err[-4000:]
    assert all(h["check/logprob_max_diff"] < 1e-3 for h in history)
    assert not outliving([p for p in seen if p.pid not in victims], within=30)
    assert not shm_left(shm_before)


def test_rlcore_scale_adds_a_rollout_worker_to_a_running_job_and_removes_one(tmp_path, warm_start_cache):
    """Scaled to 3 workers at step 3: the new one serves with the weights of the step it joined at (the engine check
    on it); scaled back to 2 once it serves: one retires; then SIGTERM stops the run (checkpointed, nothing left)."""
    env, ledger = ledger_env(tmp_path)
    run_dir, shm_before = tmp_path / "run", shm_segments()
    err = tmp_path / "stderr"

    def scale(size: int) -> int:
        result = run_cli([sys.executable, "-m", "rlcore.cli", "scale", str(run_dir), f"rollout={size}"])
        assert result.returncode == 0, result.stderr
        return len(logged(run_dir))

    with open(err, "w") as stderr:
        run = two_workers(tmp_path, warm_start_cache, 1000, env, stderr)
        try:
            wait_until(run, lambda: len(logged(run_dir)) >= 3, timeout=600)
            asked = scale(3)
            joined = wait_until(run, lambda: re.search(r"rollout worker 2 serving \(weights v(\d+)\)", err.read_text()),
                                timeout=600)
            shrunk = scale(2)
            wait_until(run, lambda: "retired" in err.read_text() and len(logged(run_dir)) >= shrunk + 3, timeout=600)
            seen = run_processes(run.pid)
            os.kill(run.pid, signal.SIGTERM)
            code = run.wait(timeout=120)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    text = err.read_text()
    assert code == 143, text[-4000:]
    history = logged(run_dir)
    steps = len(history)
    check_ledger(read_ledger(ledger), steps)
    assert sum(h["rollout/workers_added"] for h in history) == 1 == sum(h["rollout/workers_removed"] for h in history)
    alive = [h["rollout/workers_alive"] for h in history]
    assert alive[:asked] == [2.0] * asked and 3.0 in alive[asked:] and alive[-1] == 2.0, alive
    assert int(joined[1]) >= asked, (joined[0], asked)      # the current weights, not those the run started with
    assert all(h["check/logprob_max_diff"] < 1e-3 for h in history)
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert "Traceback" not in text, text[-4000:]
    assert not outliving(seen, within=30)
    assert not shm_left(shm_before)
