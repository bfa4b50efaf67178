"""Conformance checks for model plugins, on tiny random checkpoints built in-process (fp32, CPU, gloo).

A model plugin's tests call these (see docs/writing-a-model-plugin.md):

- ``tiny_checkpoint``: transformers builds the family's tiny model from ``spec.tiny_hf_config`` with randomised
  norms and routers (so that a wrong mapping changes the numbers) and writes it as an HF checkpoint;
- ``assert_logits_match``: megatron-core's forward logits equal transformers' (to ``LOGIT_TOLERANCE``);
- ``assert_round_trip_exact``: HF -> Megatron -> HF equals the safetensors file bit for bit;
- ``assert_tp_conversion_exact``: every rule's TP-sharded conversion (each rank's shard, then back) is exact;
- ``assert_expert_parallel``: at EP=2 (two processes) experts load and export exactly and the logits still match;
- the conformance sweep: ``published_config`` (a bundled published config with its sizes scaled down),
  ``assert_conforms`` (a config.json written as given, then logits and round trip), ``assert_refused`` (the plugin
  refuses a value, naming its key) and ``keys_read`` (which config keys the plugin reads, so that a sweep can show
  it varies every one).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import json
from importlib import resources
from typing import Any, Callable

import torch

from rlcore.launch import torchrun
from rlcore.specs import ModelSpec

# fp32 logits of a tiny model agree to <= 3e-7 when the mapping is right (the sweeps measure it); a wrong norm
# epsilon shows at 6e-5 to 1e-4
LOGIT_TOLERANCE = 2e-6


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT = _Omit()      # a case value that leaves the key out of config.json


def tiny_checkpoint(spec: ModelSpec, path: str, vocab_size: int = 48, seed: int = 0, hf_overrides: dict | None = None,
                    **sizes):
    """Write a random tiny HF checkpoint of ``spec``'s family to ``path``; returns the transformers model (eval).
    ``sizes`` go to ``spec.tiny_hf_config``; ``hf_overrides`` replace top-level keys of the config it returns."""
    if spec.tiny_hf_config is None:
        raise ValueError(f"model family {spec.name!r} registers no tiny_hf_config to build a tiny checkpoint from")
    return write_checkpoint({**spec.tiny_hf_config(vocab_size=vocab_size, **sizes), **(hf_overrides or {})}, path,
                            seed)


def write_checkpoint(hf_config: dict, path: str, seed: int = 0):
    """transformers builds a random model from ``hf_config`` (norms and routers randomised) and saves it (in files
    of 100 KB with an index); then config.json is rewritten exactly as given, so that keys it leaves out stay out, as in
    a published checkpoint. Returns the transformers model (eval)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model = auto_model_class(hf_config).from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] < p.shape[1]:
                p.normal_(0, 0.5)   # a decisive router: a wrong expert mapping changes the logits
        for name, b in model.named_buffers():
            if "bias" in name:      # e.g. DeepSeek-V3's expert-score correction bias
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path, max_shard_size="100KB")    # several files with an index, as published checkpoints
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    return model.eval()


def auto_model_class(hf_config: dict):
    """transformers' auto class of the config's model: a causal LM, or an image-text-to-text model (Qwen2.5-VL)."""
    import transformers

    return (transformers.AutoModelForImageTextToText if "vision_config" in hf_config
            else transformers.AutoModelForCausalLM)


def random_hf_state(hf_config: dict, scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight of ``hf_config``'s model drawn from N(0, scale^2), HF-named, for an in-process Megatron model in
    a test (``hf_state=``); the shapes come from a model built on the meta device, so nothing is allocated twice."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in
                  AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config)).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def build_megatron(spec: ModelSpec, path: str):
    """The Megatron model (eval) and converter for ``path``, in this process's parallel state."""
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights

    model, converter = build_gpt(spec, read_hf_config(path))
    load_hf_into(model, converter, read_hf_weights(path))
    return model.eval(), converter


def _ids(vocab_size: int, batch: int = 2, length: int = 12):
    ids = torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(length).unsqueeze(0).expand(batch, -1)


def assert_logits_match(model, hf_model, vocab_size: int, tolerance: float = LOGIT_TOLERANCE) -> float:
    ids, positions = _ids(vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids, positions, None), hf_model(ids).logits
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = (ours - theirs).abs().max().item()
    assert diff < tolerance, f"Megatron logits differ from transformers' by {diff}"
    return diff


def assert_round_trip_exact(model, converter, path: str) -> None:
    """transformers 5 keeps MoE experts fused in memory but writes them per expert: compare with the file."""
    from rlcore.megatron.reshard import Resharder
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


def published_config(name: str, **sizes: Any) -> dict:
    """A published config bundled in ``configs/models`` with the given keys (its sizes) replaced: a tiny
    model that keeps every other value as published."""
    with (resources.files("rlcore.presets") / "models" / f"{name}.json").open() as f:
        return {**json.load(f), **sizes}


def with_case(hf_config: dict, case: dict) -> dict:
    """``hf_config`` with ``case``'s keys set; a key set to ``OMIT`` is left out."""
    merged = {**hf_config, **case}
    return {k: v for k, v in merged.items() if v is not OMIT}


def assert_conforms(spec: ModelSpec, hf_config: dict, path: str, tolerance: float = LOGIT_TOLERANCE) -> float:
    """A checkpoint whose config.json is ``hf_config`` as given, read the way rlcore reads a user's checkpoint:
    Megatron's logits equal transformers' and HF -> Megatron -> HF is exact. Returns the largest logit difference."""
    hf_model = write_checkpoint(hf_config, path)
    model, converter = build_megatron(spec, path)
    diff = assert_logits_match(model, hf_model, hf_config["vocab_size"], tolerance)
    assert_round_trip_exact(model, converter, path)
    return diff


def assert_refused(spec: ModelSpec, hf_config: dict, key: str) -> str:
    """The plugin refuses ``hf_config`` before building anything, with a message that names ``key``."""
    from rlcore.hf_config import with_transformers_defaults
    from rlcore.megatron.model import check_model_config

    try:
        check_model_config(spec, with_transformers_defaults(hf_config))
    except ValueError as e:
        assert key in str(e), f"{spec.name}'s refusal does not name {key!r}: {e}"
        return str(e)
    raise AssertionError(f"{spec.name} accepted a config it was expected to refuse for {key!r}")


class _Recording(dict):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def keys_read(spec: ModelSpec, hf_config: dict) -> set[str]:
    """The config keys the plugin reads to build its TransformerConfig, GPTModel arguments and weight rules."""
    from rlcore.hf_config import with_transformers_defaults
    from rlcore.megatron.model import check_model_config

    recording = _Recording(with_transformers_defaults(hf_config))
    check_model_config(spec, recording)
    return recording.read - {"quantization_config"}    # the checkpoint format's, read by rlcore's loader


def sweep_tests(sweeps: dict[str, tuple[ModelSpec, dict, list[tuple[dict, str | None]]]], not_varied: set[str]):
    """The two tests of a model plugin's conformance sweep, to assign in its test module:
    ``sweeps``: name -> (spec, published config with its sizes scaled down, cases), each case (the keys it changes,
    ``OMIT`` to leave one out; the key a refusal must name, or None when the case must conform);
    ``not_varied``: keys the plugin reads that need no variation (naming the architecture, say).
    One test per case; one per sweep that fails when the plugin reads a key that no case of any of the sweeps
    varies (families that share their mapping, as DeepSeek-V3 and Moonlight, share the cases' coverage)."""
    import pytest

    params = [pytest.param(name, i, id=f"{name}-{i}-" + "-".join(case))
              for name, (_, _, cases) in sweeps.items() for i, (case, _) in enumerate(cases)]

    @pytest.mark.parametrize("sweep, index", params)
    def test_published_config_variation(sweep, index, tmp_path):
        from rlcore.megatron.parallel import init_parallel

        spec, base, cases = sweeps[sweep]
        case, refused_key = cases[index]
        hf = with_case(base, case)
        if refused_key:
            assert_refused(spec, hf, refused_key)
        else:
            init_parallel(seed=0)
            print(f"max logit difference {assert_conforms(spec, hf, str(tmp_path)):.1e}")

    @pytest.mark.parametrize("sweep", sorted(sweeps))
    def test_sweep_varies_every_key_the_plugin_reads(sweep):
        spec, base, _ = sweeps[sweep]
        varied = {key for _, _, cases in sweeps.values() for case, _ in cases for key in case}
        unvaried = keys_read(spec, base) - not_varied - varied
        assert not unvaried, f"{spec.name} reads {sorted(unvaried)}, which no case of the sweep varies"

    return test_published_config_variation, test_sweep_varies_every_key_the_plugin_reads


_EP_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from rlcore.megatron.parallel import init_parallel, shutdown_parallel
    from rlcore.plugins import load_plugins
    from rlcore_testing.models import assert_logits_match, assert_round_trip_exact, build_megatron
    plugin, family, path, vocab = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    spec = load_plugins([plugin]).registry.get("models", family)
    init_parallel(ep=2, seed=0)
    model, converter = build_megatron(spec, path)
    assert any(".local_experts." in n for n, _ in model.named_parameters()), "no expert parameters"
    assert_round_trip_exact(model, converter, path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_logits_match(model, hf_model, vocab)
    rank = dist.get_rank()
    del model, converter
    shutdown_parallel()
    print(f"EP2 OK {rank}", flush=True)   # one write: two ranks share the pipe
""")


# (processes, script, *arguments) -> the script's run on that many local ranks, its outputs captured
RankRunner = Callable[..., subprocess.CompletedProcess]


def torchrun_ranks(procs: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script args`` on ``procs`` local ranks under torchrun, one torch thread each, the outputs captured."""
    return subprocess.run([*torchrun(procs), script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_expert_parallel(plugin: str, family: str, path: str, vocab_size: int = 48,
                           ranks: RankRunner = torchrun_ranks) -> None:
    """Two processes at EP=2: each holds half the experts; the export equals the file and the logits match.
    ``ranks``: what starts them (a suite's own way of running rank scripts; default: torchrun)."""
    script = os.path.join(path, "_ep2_rank.py")
    with open(script, "w") as f:
        f.write(_EP_RANK)
    result = ranks(2, script, plugin, family, path, str(vocab_size))
    assert result.returncode == 0 and result.stdout.count("EP2 OK") == 2, result.stderr[-4000:]


def run_captured(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in a process of its own, to its end, its outputs captured."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_grpo_smoke(plugins: str, family: str, run_dir: str, steps: int = 3, *overrides: str,
                   run: Callable[..., subprocess.CompletedProcess] = run_captured) -> list[dict]:
    """``rlcore run --plugins=<plugins> model.family=<family>`` on the quickstart task for a few steps (short warm
    start, engine logprob check after every weight push), as a user would launch it. Returns the per-step metrics;
    asserts the run succeeded and the engine agreed with the actor after every sync. ``run(cmd, env, timeout)``:
    what runs the command to its end with its output captured (a suite's own way of starting runs; default:
    ``run_captured``)."""
    import json

    cmd = [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}", f"model.family={family}",
           f"trainer.steps={steps}", "warm_start.steps=20", "warm_start.target_accuracy=0", "trainer.eval_every=0",
           "trainer.check_logprobs_every=1", "trainer.export_hf=false", "run.progress=false", "trainer.loggers=[jsonl]",
           f"run.dir={run_dir}",
           f"warm_start.cache_dir={os.path.join(run_dir, 'warm_start')}", *overrides]
    result = run(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 600)
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
