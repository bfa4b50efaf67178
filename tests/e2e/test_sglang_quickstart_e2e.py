"""End to end with SGLang generating: the quickstart (real megatron-core actor, GRPO) with rollout.backend=sglang
learns as it does with vLLM, and SGLang agrees with the actor after every weight push (the engine check)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from rlcore_testing.models import reward_gain


pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")]


def test_quickstart_learns_with_sglang(tmp_path, warm_start_cache):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,sglang", "quickstart",
                             "rollout.backend=sglang", "trainer.steps=60", "trainer.eval_every=0",
                             "trainer.check_logprobs_every=10", "trainer.export_hf=false", "run.progress=false",
                             f"run.dir={run}", f"warm_start.cache_dir={warm_start_cache}"],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(run / "summary.json"))
    assert {p["name"] for p in json.load(open(run / "run.json"))["plugins"]} == {"builtin", "qwen3", "grpo", "sglang"}
    history = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # the training reward rises beyond noise (1280 samples in each 10-step window); the held-out accuracy after 60
    # steps is one noisy point on a curve that oscillates (0.61 -> 0.65 on one machine, -> 0.71 on another: the
    # warm start's own accuracy is where its 25-step evaluation first passes 0.5), so it is only asked not to fall
    first, last, z = reward_gain(history)
    assert z > 3, (first, last, z)
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"], summary
    checks = [h["check/logprob_max_diff"] for h in history if "check/logprob_max_diff" in h]
    assert len(checks) == 6 and max(checks) < 1e-4, checks
