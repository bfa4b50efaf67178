"""End to end with LoRA (``actor.lora``): the quickstart (real megatron-core actor, real vLLM engine, GRPO) learns
with rank-8 adapters, the engine agreeing with the actor after every weight sync (merged weights pushed); the run's
HF export is a plain HF model (merged weights), as is `rlcore export --merged` of its checkpoint, and its PEFT
adapter (adapter/) is `rlcore export`'s, which PEFT merges onto the base into hf/; and in a KL run the
reference policy is the starting model with the adapters off."""
import json
import os
import sys

import pytest
import torch

from runs import SHORT_QUICKSTART, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# LoRA's usual learning rate is ~10x full fine-tuning's (the quickstart's 1e-4); with it the quickstart learns in
# as many steps as full fine-tuning does
LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=0.001", "trainer.check_logprobs_every=1"]


def read_hf(directory):
    from safetensors.torch import load_file

    return {name: t for f in os.listdir(directory) if f.endswith(".safetensors")
            for name, t in load_file(os.path.join(directory, f)).items()}


def peft_merged(adapter_dir) -> dict:
    """transformers' model of the adapter's base with PEFT's adapter loaded and merged: its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir)
    return model.merge_and_unload().state_dict()


def test_quickstart_learns_with_lora_and_exports_merged_weights(tmp_path, warm_start_cache):
    """As a user launches it, in its own process (a second in-process run would tear down the vLLM groups of the
    test process's shared quickstart run)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
                      *SHORT_QUICKSTART, *LORA, f"run.dir={run_dir}", f"warm_start.cache_dir={warm_start_cache}",
                      "trainer.save_every=50"], timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    s = json.load(open(run_dir / "summary.json"))
    history = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.10, s   # the quickstart test's margin
    assert max(h["check/logprob_max_diff"] for h in history) < 1e-3     # the engine holds the merged weights
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    hf_dir = str(run_dir / "hf")
    names = list(read_hf(hf_dir))
    assert names and not [n for n in names if "lora" in n.lower()]
    # `rlcore export --merged` of the run's checkpoint (adapters only: the base read from the run's model.path)
    # merges the adapters as the run's own export does
    checkpoint = str(run_dir / "checkpoints" / "step_00000050")
    out = tmp_path / "exported"
    result = run_cli([sys.executable, "-m", "rlcore.cli", "export", "--plugins=qwen3", "--merged", checkpoint,
                      str(out)], timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    exported, live = read_hf(out), read_hf(hf_dir)
    assert sorted(exported) == sorted(live)
    assert max(float((exported[n] - live[n]).abs().max()) for n in live) < 1e-6
    # the run's PEFT adapter (adapter/) equals `rlcore export`'s, and PEFT merged onto the base gives hf/
    result = run_cli([sys.executable, "-m", "rlcore.cli", "export", "--plugins=qwen3", checkpoint,
                      str(tmp_path / "adapter")], timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter, run_adapter = read_hf(tmp_path / "adapter"), read_hf(run_dir / "adapter")
    assert sorted(adapter) == sorted(run_adapter) and all(torch.equal(adapter[n], run_adapter[n]) for n in adapter)
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json")) == \
        json.load(open(run_dir / "adapter" / "adapter_config.json"))
    assert os.path.isfile(run_dir / "adapter" / "tokenizer_config.json")
    assert max(float((merged - live[n]).abs().max()) for n, merged in peft_merged(run_dir / "adapter").items()
               if n in live) < 1e-5


def test_reference_is_the_starting_model_with_adapters_off(tmp_path):
    """A KL run (as a user launches it: its own process, the reference built as the run builds it). The first update
    trains the starting model itself (B = 0), so its KL to the reference is 0 only if the reference is the starting
    model; later updates move away from it. The reference logprobs after updates equal the starting model's, and no
    second model is built: tests/parallel/test_lora_actor.py."""
    from rlcore_testing.models import run_grpo_smoke

    history = run_grpo_smoke("qwen3,grpo,vllm", "qwen3", str(tmp_path / "run"), 3, *LORA, "algorithm.kl_coef=0.05",
                             run=run_cli)
    kl = [h["actor/kl_ref"] for h in history]
    assert kl[0] == 0.0 and kl[-1] > 0.0, kl
