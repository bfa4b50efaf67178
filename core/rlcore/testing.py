"""Conformance checks for model plugins, on tiny random checkpoints built in-process (fp32, CPU, gloo).

A model plugin's tests call these (see docs/writing-a-model-plugin.md):

- ``tiny_checkpoint``: transformers builds the family's tiny model from ``spec.tiny_hf_config`` with randomised
  norms and routers (so that a wrong mapping changes the numbers) and writes it as an HF checkpoint;
- ``assert_logits_match``: megatron-core's forward logits equal transformers';
- ``assert_round_trip_exact``: HF -> Megatron -> HF equals the safetensors file bit for bit;
- ``assert_tp_conversion_exact``: every rule's TP-sharded conversion (each rank's shard, then back) is exact;
- ``assert_expert_parallel``: at EP=2 (two processes) experts load and export exactly and the logits still match.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from rlcore.specs import ModelSpec


def tiny_checkpoint(spec: ModelSpec, path: str, vocab_size: int = 48, seed: int = 0, hf_overrides: dict | None = None,
                    **sizes):
    """Write a random tiny HF checkpoint of ``spec``'s family to ``path``; returns the transformers model (eval).
    ``sizes`` go to ``spec.tiny_hf_config``; ``hf_overrides`` replace top-level keys of the config it returns."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.tiny_hf_config is None:
        raise ValueError(f"model family {spec.name!r} registers no tiny_hf_config to build a tiny checkpoint from")
    hf_config = {**spec.tiny_hf_config(vocab_size=vocab_size, **sizes), **(hf_overrides or {})}
    config = AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] < p.shape[1]:
                p.normal_(0, 0.5)   # a decisive router: a wrong expert mapping changes the logits
        for name, b in model.named_buffers():
            if "bias" in name:      # e.g. DeepSeek-V3's expert-score correction bias
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def build_megatron(spec: ModelSpec, path: str):
    """The Megatron model (eval) and converter for ``path``, in this process's parallel state."""
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights

    model, converter = build_gpt(spec, read_hf_config(path))
    load_hf_into(model, converter, read_hf_weights(path))
    return model.eval(), converter


def _ids(vocab_size: int, batch: int = 2, length: int = 12):
    ids = torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(length).unsqueeze(0).expand(batch, -1)


def assert_logits_match(model, hf_model, vocab_size: int, tolerance: float = 1e-4) -> float:
    ids, positions = _ids(vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids, positions, None), hf_model(ids).logits
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = (ours - theirs).abs().max().item()
    assert diff < tolerance, f"Megatron logits differ from transformers' by {diff}"
    return diff


def assert_round_trip_exact(model, converter, path: str) -> None:
    """transformers 5 keeps MoE experts fused in memory but writes them per expert: compare with the file."""
    from rlcore.engine.reshard import Resharder
    from rlcore.megatron.model import read_hf_weights

    on_disk = read_hf_weights(path)
    exported = dict(Resharder(model, converter).stream())
    assert sorted(exported) == sorted(on_disk), set(exported) ^ set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def assert_tp_conversion_exact(model, converter, path: str, tp: int = 2) -> int:
    """from_hf at every TP rank, then to_hf of the shards, gives back the HF tensors (fused QKV, gate/up, vocab).
    Returns how many parameters were checked."""
    from rlcore.megatron.model import read_hf_weights

    hf = read_hf_weights(path)
    checked = 0
    for name, full in model.named_parameters():
        rule = converter.rule(name)
        dim = getattr(rule, "tp_dim", 0)
        if dim is None or ".local_experts." in name:   # replicated, or whole experts (no expert TP)
            continue
        shape = list(full.shape)
        shape[dim] //= tp
        shards = [rule.from_hf(hf, converter.layout, r, tp, torch.Size(shape)) for r in range(tp)]
        assert all(s.shape == torch.Size(shape) for s in shards), name
        for hf_name, tensor in rule.to_hf(shards, converter.layout):
            assert torch.equal(tensor, hf[hf_name]), (name, hf_name)
        placed = [torch.full_like(hf[n], float("nan")) for n in rule.hf_names()]   # the weight sync's direct path
        for r, shard in enumerate(shards):
            for view, source in rule.shard_to_hf(shard, placed, r, tp, converter.layout):
                view.copy_(source)
        for hf_name, tensor in zip(rule.hf_names(), placed):
            assert torch.equal(tensor, hf[hf_name]), (name, hf_name, "shard_to_hf")
        checked += 1
    return checked


_EP_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from rlcore.megatron.parallel import init_parallel
    from rlcore.plugins import load_plugins
    from rlcore.testing import assert_logits_match, assert_round_trip_exact, build_megatron
    plugin, family, path, vocab = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    spec = load_plugins([plugin]).registry.get("models", family)
    init_parallel(ep=2, seed=0)
    model, converter = build_megatron(spec, path)
    assert any(".local_experts." in n for n, _ in model.named_parameters()), "no expert parameters"
    assert_round_trip_exact(model, converter, path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_logits_match(model, hf_model, vocab)
    print(f"EP2 OK {dist.get_rank()}", flush=True)   # one write: two ranks share the pipe
""")


def assert_expert_parallel(plugin: str, family: str, path: str, vocab_size: int = 48, port: int = 29681) -> None:
    """Two processes at EP=2: each holds half the experts; the export equals the file and the logits match."""
    script = os.path.join(path, "_ep2_rank.py")
    with open(script, "w") as f:
        f.write(_EP_RANK)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={port}", script, plugin, family, path, str(vocab_size)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.count("EP2 OK") == 2, result.stderr[-4000:]


def run_grpo_smoke(plugins: str, family: str, run_dir: str, steps: int = 3, *overrides: str) -> list[dict]:
    """``rlcore run --plugins=<plugins> model.family=<family>`` on the quickstart task for a few steps (short warm
    start, engine logprob check after every weight push), as a user would launch it. Returns the per-step metrics;
    asserts the run succeeded and the engine agreed with the actor after every sync."""
    import json

    cmd = [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}", f"model.family={family}",
           f"trainer.steps={steps}", "warm_start.steps=20", "trainer.eval_every=0", "trainer.check_logprobs_every=1",
           "trainer.export_hf=false", "run.progress=false", "trainer.loggers=[jsonl]", f"run.dir={run_dir}",
           f"warm_start.cache_dir={os.path.join(run_dir, 'warm_start')}", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert len(history) == steps, history
    worst = max(h["check/logprob_max_diff"] for h in history)
    assert worst < 1e-3, f"engine and actor disagree after a weight sync: max logprob diff {worst}"
    return history


def reward_gain(history: list[dict], window: int = 10) -> tuple[float, float, float]:
    """Mean training reward over the first and the last ``window`` steps, and their difference in standard errors
    (from the per-step spread): "the reward went up beyond noise" is a z of 3 or more."""
    import statistics

    rewards = [h["reward/mean"] for h in history]
    first, last = rewards[:window], rewards[-window:]
    se = (statistics.variance(first) / window + statistics.variance(last) / window) ** 0.5
    gain = statistics.mean(last) - statistics.mean(first)
    return statistics.mean(first), statistics.mean(last), gain / se if se else float("inf") * gain
