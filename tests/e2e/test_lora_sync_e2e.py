"""End to end, ``rollout.lora=adapters``: the quickstart with rank-8 LoRA (real megatron-core actor, real vLLM engine
serving the base weights with LoRA on, GRPO), colocated and async (the push to a Ray rollout worker). Every sync
sends the adapters only, an order of magnitude fewer bytes than the model's; the engine check passes on every step
with the trainer's tolerance (the run stops past it). Had the engine not applied the adapters, the check would have
stopped the run at step 2 (measured: max |logprob diff| 0.64 > 0.001)."""
import json
import os
import sys

import pytest

from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ADAPTERS = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=0.001", "trainer.check_logprobs_every=1",
            "rollout.lora=adapters"]
PROJECTIONS = 4 * 7     # the tiny Qwen3's layers x (q, k, v, o, gate, up, down)


def model_bytes(warm_start_cache) -> int:
    entry = next(p for p in warm_start_cache.iterdir() if p.is_dir())
    return sum(f.stat().st_size for f in entry.iterdir() if f.suffix == ".safetensors")


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_adapters_only_sync_passes_the_engine_check(tmp_path, warm_start_cache, mode):
    """As a user launches it, in its own process."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
                      "trainer.steps=3", "trainer.eval_every=0", "run.progress=false", "trainer.export_hf=false",
                      *ADAPTERS, f"trainer.mode={mode}", "rollout.max_staleness=0", f"run.dir={run_dir}",
                      f"warm_start.cache_dir={warm_start_cache}"],
                     timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    history = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(history) == 3 and all(h["check/logprob_max_diff"] < 1e-3 for h in history), history
    synced = [h for h in history if "sync/bytes" in h]
    assert len(synced) >= 2     # after each update (async: also the first push)
    for h in synced:
        assert h["sync/tensors"] >= 2 * PROJECTIONS     # lora_A and lora_B of every projection (+ async: the config)
        assert 8 * h["sync/bytes"] < model_bytes(warm_start_cache), (h["sync/bytes"], model_bytes(warm_start_cache))
