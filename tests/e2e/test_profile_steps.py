"""trainer.profile_steps: a real 3-step quickstart run on two Ray workers profiles step 2 only, a chrome trace and a
memory record per worker rank and phase; bad values are refused in one line before anything starts."""
import json
import sys

import pytest

from runs import run_cli, run_to_end

PHASES = ("sync", "rollout", "logprobs", "train")


def _events(path):
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parallel
def test_a_profiled_step_leaves_a_trace_per_rank_and_phase(tmp_path, warm_start_cache):
    run_dir = tmp_path / "run"
    run_to_end([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
                "trainer.steps=3", "trainer.profile_steps=[2]", "trainer.world_size=2", "trainer.eval_every=0",
                "trainer.export_hf=false", "run.progress=false", f"run.dir={run_dir}",
                f"warm_start.cache_dir={warm_start_cache}"])
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    profile = run_dir / "profile"
    assert [p.name for p in profile.iterdir()] == ["step2"]          # nothing for steps 1 and 3
    written = sorted(p.name for p in (profile / "step2").iterdir())
    assert written == sorted(f"{phase}-rank{rank}{suffix}" for phase in PHASES for rank in (0, 1)
                             for suffix in (".json", "-memory.json")), written
    for rank in (0, 1):
        ops = {e["name"] for e in _events(profile / "step2" / f"train-rank{rank}.json")}
        assert {"aten::mm", "aten::matmul"} <= ops and any("Backward" in op for op in ops), sorted(ops)[:50]
        rollout = {e["name"] for e in _events(profile / "step2" / f"rollout-rank{rank}.json")}
        assert any(op.startswith("aten::") for op in rollout), sorted(rollout)[:50]   # the engine ran in this rank
        assert _events(profile / "step2" / f"sync-rank{rank}.json")                    # the push copied tensors
        memory = json.loads((profile / "step2" / f"train-rank{rank}-memory.json").read_text())
        assert memory["rss_peak_bytes"] >= memory["rss_end_bytes"] > 0 and memory["top_cpu_memory_ops"], memory


@pytest.mark.parametrize("value, expected", [
    ("[0]", "config key 'trainer.profile_steps' = [0] is not allowed: use a list of step numbers >= 1"),
    ("[2,9]", "trainer.profile_steps [2, 9] has step(s) [9] after the last step, trainer.steps = 3"),
    ("two", "config key 'trainer.profile_steps[0]' has an invalid value 'two'"),
])
def test_bad_profile_steps_are_one_line(value, expected):
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--dry-run", "quickstart", "trainer.steps=3",
                      f"trainer.profile_steps={value}"], timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
