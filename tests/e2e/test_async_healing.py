"""Async mode heals its rollout side (real vLLM in Ray rollout workers, real megatron-core trainer): rollout workers
SIGKILLed at random while the run trains are replaced, their groups start again on the others, and the run finishes
every step — each prompt trained once at most, every draw before the last ones trained whole (a ledger of the
prompt ids each step trained, written by a plugin's ``rlcore_rollout_end`` hook), the staleness bound held, nothing
left running after it."""
import glob
import json
import os
import random
import signal
import time

import pytest

from runs import ENV, async_quickstart, install_distribution, logged, ray_workers, run_processes, start, wait_until
from test_async_failures import outliving

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


def ledger_run(tmp_path, cache, kills_after: list[int], steps: int, seed: int, *extra):
    """An async run with two rollout workers and the ledger plugin; a random rollout worker (serving, or a replacement
    still starting) SIGKILLed once each of ``kills_after`` steps is logged. Returns the run dir, its exit code, stderr,
    the ledger, the victims' pids and the run's processes seen last."""
    site, ledger = tmp_path / "site", tmp_path / "ledger.jsonl"
    site.mkdir()
    install_distribution(site, "rlcore-ledger", "ledger_plugin", LEDGER_PLUGIN.format(ledger=str(ledger)),
                         entry="ledger")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    run_dir, chosen, victims = tmp_path / "run", random.Random(seed), []
    with open(tmp_path / "stderr", "w") as stderr:
        run = start(async_quickstart(run_dir, cache, "rollout.world_size=2", "trainer.check_logprobs_every=1", *extra,
                                     plugins="qwen3,grpo,vllm,ledger", steps=steps), stderr=stderr, env=env)
        try:
            for after in kills_after:
                workers = wait_until(run, lambda: len(logged(run_dir)) >= after
                                     and [p for p in ray_workers(run.pid, "RolloutWorker") if p.pid not in victims],
                                     timeout=600)
                victim = chosen.choice(workers)
                victims.append(victim.pid)
                victim.send_signal(signal.SIGKILL)
            seen = run_processes(run.pid)
            code = run.wait(timeout=600)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    return run_dir, code, (tmp_path / "stderr").read_text(), lines, victims, seen


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
    shm_before = set(glob.glob("/dev/shm/rlcore-*"))
    run_dir, code, err, lines, victims, seen = ledger_run(tmp_path, warm_start_cache, [3, 8, 20], steps, seed)
    assert code == 0, err[-4000:]
    history = logged(run_dir)
    check_ledger(lines, steps)
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert sum(h["rollout/restarts"] for h in history) == len(victims), [h["rollout/restarts"] for h in history]
    assert err.count("a replacement is starting") == len(victims), err[-4000:]
    assert max(h["rollout/workers_alive"] for h in history[-5:]) >= 1
    # a replacement served: the engine check after each push held on every worker, new ones included
    assert "serving again" in err, err[-4000:]
    assert all(h["check/logprob_max_diff"] < 1e-3 for h in history)
    assert not outliving([p for p in seen if p.pid not in victims], within=30)
    new = set(glob.glob("/dev/shm/rlcore-*")) - shm_before
    if new:
        time.sleep(2)            # a segment of another test's run lives for milliseconds (created, mapped, unlinked)
    assert not [p for p in new if os.path.exists(p)]
