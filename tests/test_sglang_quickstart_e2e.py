"""End to end with SGLang generating: the quickstart (real megatron-core actor, GRPO) with rollout.backend=sglang
learns as it does with vLLM, and SGLang agrees with the actor after every weight push (the engine check)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")]


def test_quickstart_learns_with_sglang(tmp_path, warm_start_cache):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,sglang", "quickstart",
                             "rollout.backend=sglang", "trainer.steps=50", "trainer.eval_every=0",
                             "trainer.check_logprobs_every=10", "trainer.export_hf=false", "run.progress=false",
                             f"run.dir={run}", f"warm_start.cache_dir={warm_start_cache}"],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(run / "summary.json"))
    assert {p["name"] for p in json.load(open(run / "run.json"))["plugins"]} == {"builtin", "qwen3", "grpo", "sglang"}
    # 200 held-out prompts: +0.10 is several standard errors, not noise (as the vLLM quickstart test)
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.10, summary
    history = [json.loads(line) for line in open(run / "metrics.jsonl")]
    checks = [h["check/logprob_max_diff"] for h in history if "check/logprob_max_diff" in h]
    assert len(checks) == 5 and max(checks) < 1e-4, checks
