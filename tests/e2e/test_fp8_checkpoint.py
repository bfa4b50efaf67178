"""Checkpoints in the published block FP8 format (DeepSeek-V3 as released, Qwen3-FP8) load as the model they encode:
Megatron's logits equal transformers' run on the weights dequantized here block by block from safetensors' own
reader, at world 1 and TP2; the MTP layer is skipped; the export holds no FP8 and no quantization_config."""
import json
import os
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore_testing.models import tiny_checkpoint
from rlcore_testing.fp8 import quantize_checkpoint
from runs import run_cli, torchrun

SIZES = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=96,
             max_position_embeddings=64)
BLOCK = (16, 40)       # tiny models: several blocks per weight, partial ones at the edges (published: 128 x 128)


def _spec(family: str):
    if family == "deepseek_v3":
        from rlcore_model_deepseek.plugin import DEEPSEEK_V3
        return DEEPSEEK_V3
    from rlcore_model_qwen3.plugin import QWEN3
    return QWEN3


def dequantized_copy(fp8_dir: str, out: str, num_layers: int) -> None:
    """The model an FP8 checkpoint encodes, as a plain checkpoint: each block's FP8 values times its scale, read
    with safetensors' own reader; the MTP layer left out."""
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    block = config.pop("quantization_config")["weight_block_size"]
    stored = {n: t for f in os.listdir(fp8_dir) if f.endswith(".safetensors")
              for n, t in load_file(os.path.join(fp8_dir, f)).items()}
    plain = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv") or (name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale, b0, b1 = stored[name + "_scale_inv"], *block
            w = torch.empty(t.shape)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = t[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() \
                        * scale[i, j]
            t = w
        plain[name] = t
    os.makedirs(out, exist_ok=True)
    save_file(plain, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 0
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def fp8(request, tmp_path_factory):
    """(family, FP8 checkpoint dir in several files with an index, its dequantized plain copy)."""
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    tiny_checkpoint(_spec(request.param), str(root / "bf16"), **SIZES)
    stored = quantize_checkpoint(str(root / "bf16"), str(root / "fp8"), BLOCK, shard_bytes=24 << 10,
                                 mtp_layers=1 if request.param == "deepseek_v3" else 0)
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert os.path.exists(root / "fp8" / "model.safetensors.index.json")
    dequantized_copy(str(root / "fp8"), str(root / "plain"), SIZES["num_layers"])
    return request.param, str(root / "fp8"), str(root / "plain")


def test_fp8_checkpoint_loads_as_the_model_it_encodes(fp8, tmp_path, caplog):
    import logging

    from transformers import AutoModelForCausalLM

    from rlcore.megatron.parallel import init_parallel
    from rlcore_testing.models import assert_logits_match, build_megatron

    family, path, plain = fp8
    init_parallel(seed=0)
    with caplog.at_level(logging.INFO, logger="rlcore.load"):
        model, converter = build_megatron(_spec(family), path)
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    diff = assert_logits_match(model, reference, vocab_size=48)
    print(f"{family}: largest logit difference {diff:.1e}")
    messages = [r.getMessage() for r in caplog.records]
    assert any("from 2 of" in m or "tensors" in m for m in messages), messages
    if family == "deepseek_v3":       # the MTP layer: present in the files, skipped with a log line
        assert any("skipped decoder layer(s) 3 beyond the model's 3" in m for m in messages), messages

    from rlcore.megatron.reshard import Resharder
    from rlcore.hf_checkpoint import TensorSpec, write_sharded

    resharder = Resharder(model, converter)
    specs = [TensorSpec(n, s, e.dtype) for b in resharder.buckets for e in b.entries for n, s in e.hf]
    write_sharded(str(tmp_path), specs, resharder.stream(), 1 << 30)
    exported = load_file(tmp_path / "model.safetensors")
    on_disk = load_file(os.path.join(plain, "model.safetensors"))
    assert sorted(exported) == sorted(on_disk), "the export holds no MTP layer and no scales"
    assert all(torch.equal(exported[n], on_disk[n]) for n in on_disk)


_TP2_RANK = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from rlcore.megatron.parallel import init_parallel
    from rlcore.plugins import load_plugins
    from rlcore_testing.models import assert_logits_match, build_megatron
    family, path, plain = sys.argv[1:4]
    spec = load_plugins().registry.get("models", family)
    init_parallel(tp=2, seed=0)
    model, _ = build_megatron(spec, path)
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    import rlcore_testing.models as t
    ids, positions = t._ids(48)
    with torch.no_grad():
        ours = gather_from_tensor_model_parallel_region(model(ids, positions, None))[..., :48]
        diff = (ours - reference(ids).logits).abs().max().item()
    assert diff < t.LOGIT_TOLERANCE, diff
    print(f"TP2 OK {diff:.1e}", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parallel
def test_fp8_checkpoint_loads_at_tp2(fp8, tmp_path):
    family, path, plain = fp8
    script = tmp_path / "rank.py"
    script.write_text(_TP2_RANK)
    result = torchrun(2, script, family, path, plain)
    assert result.returncode == 0 and result.stdout.count("TP2 OK") == 2, result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.e2e
def test_grpo_from_an_fp8_checkpoint_serves_the_dequantized_weights(quickstart_model, tmp_path):
    """The quickstart's model written in block FP8: the actor loads it dequantized, vLLM starts without weights
    (it would serve FP8 differently, and on CPU not at all) and after each push serves what the actor holds: the
    engine check after every sync passes (placeholder weights would fail it)."""
    from rlcore_testing.models import run_grpo_smoke

    fp8_dir = str(tmp_path / "fp8")
    quantize_checkpoint(quickstart_model, fp8_dir, (32, 48), shard_bytes=256 << 10)
    history = run_grpo_smoke("qwen3,grpo,vllm", "qwen3", str(tmp_path / "run"), 3, f"model.path={fp8_dir}",
                             run=run_cli)
    print("engine check after each push:", [h["check/logprob_max_diff"] for h in history])
