"""The vLLM backend serving LoRA adapters (``rollout.lora=adapters``): started with ``lora_rank``, each
``load_adapters`` (PEFT's tensors and config, as rlcore's adapters-only sync hands them over) replaces the adapter it
serves, and its logprobs are transformers + PEFT's with that adapter, scored several sequences at once (the CPU build
needs one per call: see ``VLLMRollout.score``). The engine runs in a child process: vLLM allows one in-process engine
per process, and the test session's quickstart fixture may hold one."""
import importlib.util
import json
import os
import sys

import pytest
from runs import run_cli

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = [pytest.mark.slow]

SCRIPT = """
import json, sys
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlcore.config.schema import RolloutConfig
from rlcore.lora.peft import ADAPTER_WEIGHTS
from rlcore.plugins import load_plugins
from rlcore_testing.models import write_checkpoint
from rlcore_testing.contract import contract_hf_config, reference_logprobs, write_word_tokenizer

path = sys.argv[1]
hf_config = contract_hf_config()
write_checkpoint(hf_config, path)
write_word_tokenizer(path, hf_config["vocab_size"], hf_config["eos_token_id"])
sequences = [[3, 9, 4, 17, 8, 30, 2], [5, 11, 40, 6, 7, 1], [12, 13, 14, 15, 16, 17, 18, 19]]
start = [2, 3, 4]


def adapter(seed):
    # a PEFT adapter on every projection, B random (PEFT starts it at 0), saved as save_pretrained writes it
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    model.save_pretrained(f"{path}/adapter{seed}")
    with open(f"{path}/adapter{seed}/adapter_config.json") as f:
        config = json.load(f)
    return model, load_file(f"{path}/adapter{seed}/{ADAPTER_WEIGHTS}"), config


def expected(model):
    return [reference_logprobs(model, s, st)[torch.arange(len(s) - st), torch.tensor(s[st:])].tolist()
            for s, st in zip(sequences, start)]


spec = load_plugins(["vllm"]).registry.get("rollout_backends", "vllm")
engine = spec.factory(path, RolloutConfig(backend="vllm", kv_cache_gib=0.01, tp=1), seed=0, max_model_len=64,
                      distributed=False, lora_rank=spec.lora_adapters and 8)
base = engine.score(sequences, start)
result = {"lora_adapters": spec.lora_adapters, "loaded": []}
for version, seed in ((1, 1), (2, 2)):
    model, tensors, config = adapter(seed)
    with model.disable_adapter():
        result["base_diff"] = max(abs(a - b) for got, want in zip(base, expected(model)) for a, b in zip(got, want))
    engine.load_adapters(tensors, config, version)
    got, want = engine.score(sequences, start), expected(model)
    result["loaded"].append({
        "version": engine.version,
        "diff": max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)),
        "moved": max(abs(a - b) for g, b0 in zip(got, base) for a, b in zip(g, b0)),
        "served": sorted(engine.llm.llm_engine.list_loras())})
engine.stop()
print(json.dumps(result))
"""


def test_vllm_serves_each_loaded_adapter_as_peft_does(tmp_path):
    script = tmp_path / "lora.py"
    script.write_text(SCRIPT)
    result = run_cli([sys.executable, str(script), str(tmp_path)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["lora_adapters"] is True
    assert seen["base_diff"] < 2e-6          # before any adapter: the base model
    for version, loaded in enumerate(seen["loaded"], start=1):
        assert loaded["version"] == version
        assert loaded["moved"] > 0.05, loaded    # the adapter changes the model ...
        assert loaded["diff"] < 2e-6, loaded     # ... as PEFT's does (the contract's tolerance)
        assert loaded["served"] == [version + 1], loaded   # the one before was unloaded
