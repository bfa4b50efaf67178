"""Every bench/ script run in its smoke mode (``--smoke``: the real code path end to end at the smallest size) as a
user runs it, so that a benchmark cannot rot unseen (bench/load_memory.py once failed on a lost import, and the
long_tail plugin on a changed ``AgentSpec.build``, with no test to tell). The smoke's numbers mean nothing; what is
checked is that it ends well and still prints its summary line last."""
import os
import re
import sys
from pathlib import Path

import pytest
from runs import run_cli

BENCH = Path(__file__).resolve().parents[2] / "bench"
RATIO = r"-?\d+\.\d+"

# each script and the shape of its summary line, the last line it prints
SMOKES = {
    "async_throughput.py": rf"async speedup n/a quickstart, {RATIO} long-tailed, n/a slow-world",
    "checkpoint_save.py": rf"tp2 +\d+M( +{RATIO}){{4}}( +\d+){{2}} +{RATIO}x, {RATIO}x",
    "dispatch.py": rf"worst dispatch ratio to the copy floor {RATIO}x \(\d+ MB batch, 2 workers\)",
    "load_memory.py": rf"worst load ratio {RATIO}, worst export ratio {RATIO}",
    "long_responses.py": rf"logits 32 tokens at a time: -?\d+ MB less peak memory than all at once, {RATIO}x its "
                         r"throughput",
    "lora_memory.py": rf"lora optimizer state {RATIO}% of full",
    "reward_model_scoring.py": rf"reward model scoring / plain forward {RATIO}x \(\d+ sequences, \d+ tokens\)",
    "rollout_floor.py": rf"worst per-request/offline {RATIO}x \(vllm (quickstart|long)\)",
    "rollout_healing.py": rf"rollout_healing: steps/s after losing 1 of 2 rollout workers at step 2: {RATIO} vs "
                          r"n/a undisturbed \(ratio n/a\); replacement (serving after -?\d+\.\d+ s|not serving "
                          r"by the end)",
    "routing_replay.py": rf"routing_replay: routes \d+ B/token \(DeepSeek-V3\), step time with replay {RATIO}x, with "
                         rf"replay and live-routing metrics {RATIO}x \(tiny qwen3_moe, hf\)",
    "step_breakdown.py": rf"vllm: weight sync .* sync / copy = {RATIO}x; median step {RATIO} s \(target < 0\.4 s\): "
                         r"(NOT )?MET",
    "trl_side_by_side.py": rf"rlcore/TRL step time {RATIO}x, final accuracy {RATIO} vs {RATIO}",
    "visual_tokens.py": rf"visual/text-only tokens/s: rollout {RATIO}x, update {RATIO}x \(\d+ prompts, \d+ tokens "
                        r"each\)",
    "weight_push.py": rf"push shm/collectives {RATIO}x",
    "weight_sync.py": rf"worst sync/ingest {RATIO}x \(vllm tp2\)",
}
# modules the scripts use rather than run, and the smokes that run them: process_memory (each process's resident and
# peak memory) is imported by load_memory and lora_memory; long_tail/bench_long_tail (the long_tail agent and
# answer_before_tail reward, the slow_tool agent: a plugin through its dist-info on PYTHONPATH) is async_throughput's
# long-tailed and slow-world workloads
HELPERS = {"process_memory.py": ["load_memory.py", "lora_memory.py"],
           "long_tail/bench_long_tail.py": ["async_throughput.py"]}


def test_every_bench_script_has_a_smoke():
    """A script added to bench/ needs a smoke here (or to be a helper of one that has)."""
    scripts = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")}
    assert scripts == set(SMOKES) | set(HELPERS)
    assert {user for users in HELPERS.values() for user in users} <= set(SMOKES)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKES))
def test_smoke(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)         # where a script writes what it keeps
    done = run_cli([sys.executable, str(BENCH / script), "--smoke"], {**os.environ, "OMP_NUM_THREADS": "1"}, 900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(SMOKES[script], last), last
