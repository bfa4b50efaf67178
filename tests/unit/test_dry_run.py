"""`rlcore run --dry-run`: the published large-scale presets fit their models (sizes from bundled HF configs,
parameter counts as published), broken layouts are refused with the reason, and nothing starts."""
import sys

import pytest

from rlcore.config import load_config
from rlcore.config.loader import preset_names
from rlcore.plugins import load_plugins
from rlcore.dry_run import dry_run
from rlcore.sizing import read_model_config

from runs import run_cli

LARGE = [p for p in preset_names() if p.endswith("gpu")]
PUBLISHED_BILLIONS = {"deepseek-v3": 671, "qwen3-235b-a22b": 235, "qwen3-30b-a3b": 30.5, "moonlight-16b-a3b": 16,
                      "qwen3-8b": 8.2, "qwen2.5-vl-7b": 8.29, "qwen2.5-vl-72b": 73.4, "qwen2.5-7b": 7.61,
                      "qwen2-7b": 7.62, "llama-3.1-8b": 8.03}


@pytest.fixture(scope="module")
def registry():
    return load_plugins(["qwen3", "deepseek", "qwen2", "qwen2_vl", "llama"]).registry


def check(registry, preset, *overrides):
    cfg = load_config(preset, list(overrides))
    return dry_run(cfg, registry.get("models", cfg.model.family))


def test_there_are_presets_for_every_published_recipe():
    assert len(LARGE) == 18 and {p.rsplit("-", 1)[0] for p in LARGE} == {
        "deepseek-v3-671b", "qwen3-235b-a22b", "qwen3-30b-a3b", "moonlight-16b-a3b", "qwen3-8b-gsm8k",
        "qwen2.5-7b-gsm8k", "qwen2-7b", "llama-3.1-8b", "qwen2.5-vl-7b-geo3k", "qwen2.5-vl-72b-geo3k"}


@pytest.mark.parametrize("preset", LARGE)
def test_published_presets_fit(registry, preset):
    problems, report = check(registry, preset)
    assert not problems, problems
    billions = float(report.split(": ", 1)[1].split("B parameters")[0])
    published = next(v for k, v in PUBLISHED_BILLIONS.items() if preset.startswith(k.split("-a")[0]))
    assert abs(billions - published) / published < 0.02, (billions, published)
    assert "per device" in report and "CPU/node" in report


@pytest.mark.parametrize("overrides, expected", [
    (["actor.parallel.pp=8", "actor.parallel.last_stage_layers=0", "trainer.world_size=512"],
     "61 layers do not split evenly over actor.parallel.pp = 8"),
    (["actor.parallel.last_stage_layers=2"], "leaves 59 of 61 layers for 11 stages"),
    (["actor.parallel.ep=3", "trainer.world_size=288"], "experts = 256 is not divisible by actor.parallel.ep = 3"),
    (["actor.parallel.tp=6", "trainer.world_size=576"], "attention heads = 128 is not divisible by actor.parallel.tp"),
    (["actor.parallel.sp=false"], "a MoE model at actor.parallel.tp = 8 needs actor.parallel.sp=true"),
])
def test_layouts_that_do_not_fit_are_refused(registry, overrides, expected):
    problems, _ = check(registry, "deepseek-v3-671b-96gpu", *overrides)
    assert any(expected in p for p in problems), problems


def test_query_groups_must_split_over_tp(registry):
    problems, _ = check(registry, "qwen3-30b-a3b-8gpu", "actor.parallel.tp=8", "actor.parallel.sp=true",
                        "actor.parallel.ep=1")
    assert any("query groups (KV heads) = 4 is not divisible by actor.parallel.tp = 8" in p for p in problems)


def test_offloading_the_optimizer_moves_its_memory_to_the_host(registry):
    _, on_device = check(registry, "qwen3-30b-a3b-8gpu", "actor.optim.name=adam", "actor.optim.offload_fraction=0")
    _, offloaded = check(registry, "qwen3-30b-a3b-8gpu")        # hybrid_adam, offload_fraction 1
    optimizer = [float(r.split("optimizer ")[1].split(" GiB")[0]) for r in (on_device, offloaded)]
    # bf16: of Adam's 12 bytes an element, the fp32 master copy (4) stays on the device
    assert optimizer[1] == pytest.approx(optimizer[0] / 3, abs=0.1)
    assert "CPU/node   0 GiB while training" in on_device and "CPU/node   0 GiB while training" not in offloaded


@pytest.mark.parametrize("overrides, expected", [
    (["actor.optim.name=adam"], "actor.optim.offload_fraction = 1 needs the hybrid CPU/GPU optimizer"),
    (["actor.optim.offload_fraction=0"], "hybrid_adam with actor.optim.offload_fraction = 0 keeps all optimizer"),
    # the critic's optimizer too, where the algorithm trains one (as the run checks it)
    (["algorithm.name=ppo", "critic.optim.name=adam", "critic.optim.offload_fraction=1"],
     "critic.optim.offload_fraction = 1 needs the hybrid CPU/GPU optimizer"),
])
def test_dry_run_refuses_an_offload_fraction_its_optimizer_does_not_take(overrides, expected):
    from rlcore.dry_run import command as cli_dry_run
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=expected):
        cli_dry_run(load_config("qwen3-30b-a3b-8gpu", overrides), load_plugins(["qwen3", "grpo", "ppo"]))


def test_dry_run_refuses_a_config_of_another_family_in_one_line():
    """Qwen3-30B-A3B's config under model.family=qwen3 (the dense family): named, not a KeyError from the mapping."""
    from rlcore.dry_run import command as cli_dry_run
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model config 'qwen3-30b-a3b': it holds a Qwen3MoeForCausalLM checkpoint "
                                          r"but model.family 'qwen3' handles Qwen3ForCausalLM"):
        cli_dry_run(load_config("qwen3-30b-a3b-8gpu", ["model.family=qwen3"]), load_plugins(["qwen3", "grpo", "vllm"]))


def test_dry_run_refuses_a_quantization_the_run_cannot_load(tmp_path):
    """A published DeepSeek-V3 config with its block FP8 quantization plans; the same model in GPTQ is refused."""
    import json

    from rlcore.dry_run import command as cli_dry_run
    from rlcore.errors import ConfigError
    from rlcore_testing.models import published_config

    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    plugins = load_plugins(["deepseek", "grpo", "vllm"])
    for quantization in (fp8, {"quant_method": "gptq", "bits": 4}):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**published_config("deepseek-v3"), "quantization_config": quantization}))
        cfg = load_config("deepseek-v3-671b-128gpu", [f"model.hf_config={path}"])
        if quantization is fp8:
            assert cli_dry_run(cfg, plugins) == 0
        else:
            with pytest.raises(ConfigError, match="quant_method 'gptq'"):
                cli_dry_run(cfg, plugins)


def test_cli_dry_run_prints_the_plan_and_exits(tmp_path):
    ok = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--dry-run", "deepseek-v3-671b-128gpu"],
                 timeout=120)
    assert ok.returncode == 0 and "671.0B parameters" in ok.stdout, ok.stderr[-2000:]
    bad = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--dry-run", "deepseek-v3-671b-128gpu",
                   "actor.parallel.last_stage_layers=0"], timeout=120)
    assert bad.returncode == 2 and "61 layers do not split evenly over actor.parallel.pp = 16" in bad.stderr
    none = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--dry-run"], timeout=120)
    assert none.returncode == 2 and "needs the model's sizes: set model.path" in none.stderr


def test_a_reference_policy_is_counted_where_it_lives(registry, capsys):
    """With a KL term the frozen reference is a second copy of the parameters: on the device, or (offloaded, the
    default where the actor offloads its params, as this preset does) in the host's share per node."""
    from rlcore.dry_run import command as cli_dry_run
    from rlcore.megatron.model import transformer_config
    from rlcore.sizing import estimate, read_model_config

    def plan(*overrides, reference=True):
        cfg = load_config("qwen3-30b-a3b-8gpu", list(overrides))
        hf = read_model_config(cfg)
        config = transformer_config(registry.get("models", cfg.model.family), hf, cfg.actor.dtype)
        return estimate(config, hf, cfg, reference)

    without, on_host, on_device = plan(reference=False), plan(), plan("actor.offload.reference=false")
    params, devices = without["per_device"]["params"], 8
    assert on_device["per_device"] == {**without["per_device"], "reference": params}
    assert on_host["per_device"] == without["per_device"]
    for when in ("training", "rollout"):
        key = f"cpu_per_node_{when}"
        assert on_host[key] == pytest.approx(without[key] + params * devices) and on_device[key] == without[key]
    plugins = load_plugins(["qwen3", "grpo", "vllm"])   # the CLI asks the algorithm whether it keeps a reference
    for overrides in ([], ["algorithm.kl_coef=0.1"], ["algorithm.kl_coef=0.1", "actor.offload.reference=false"]):
        assert cli_dry_run(load_config("qwen3-30b-a3b-8gpu", overrides), plugins) == 0
    no_kl, kl_on_host, kl_on_device = capsys.readouterr().out.split("model      ")[1:]
    assert "reference" not in no_kl
    assert "on the host between its passes" in kl_on_host and "+ reference" not in kl_on_host
    assert "kept on the device" in kl_on_device and "+ reference" in kl_on_device


def test_an_async_plan_names_its_rollout_workers(registry, capsys):
    from rlcore.dry_run import command as cli_dry_run

    for tp, workers, gib in ((1, 2, "56.9"), (2, 1, "28.4")):
        cfg = load_config("qwen3-30b-a3b-8gpu", ["trainer.mode=async", "rollout.world_size=2", f"rollout.tp={tp}",
                                                 "rollout.max_staleness=2", "rollout.partial=true"])
        assert cli_dry_run(cfg, load_plugins(None)) == 0
        assert (f"rollout    async: {workers} rollout worker(s) of their own, one engine each at tp {tp} ({gib} GiB "
                f"of weights in 16-bit per process) and its KV cache; max_staleness 2, partial True"
                ) in capsys.readouterr().out


def test_routing_replay_counts_the_routes_it_carries(registry):
    """With actor.moe.routing_replay=rollout the plan counts the routed experts the batch carries, by hand: Qwen3-
    30B-A3B's 48 MoE layers x top-8 x int16 = 768 B a token, DeepSeek-V3's 61 - 3 dense = 58 x top-8 = 928 B; each
    preset samples 128 prompts x 16 up to 8192 response tokens. None without replay."""
    from rlcore.megatron.model import transformer_config
    from rlcore.sizing import routes_memory

    for preset, per_token, context, dp in (("qwen3-30b-a3b-8gpu", 48 * 8 * 2, 40960, 8),
                                           ("deepseek-v3-671b-128gpu", 58 * 8 * 2, 163840, 1)):
        assert "routes" not in check(registry, preset)[1]
        cfg = load_config(preset, ["actor.moe.routing_replay=rollout"])
        hf = read_model_config(cfg)
        r = routes_memory(transformer_config(registry.get("models", cfg.model.family), hf, cfg.actor.dtype), hf,
                          cfg, dp)
        samples = 128 * 16
        assert (r["per_token"], r["context"], r["samples"], r["rank_samples"]) == (per_token, context, samples,
                                                                                    samples // dp)
        assert r["sample_response"] == 8192 * per_token and r["sample_context"] == context * per_token
        assert r["batch_response"] == samples * 8192 * per_token and r["batch_context"] == samples * context * per_token
        assert r["rank_response"] == r["batch_response"] // dp
        assert r["node_response"] == min(dp, 8) * r["rank_response"]    # one copy per share on a node of 8
    _, report = check(registry, "qwen3-30b-a3b-8gpu", "actor.moe.routing_replay=rollout")
    line = next(row for row in report.splitlines() if row.startswith("routes"))
    for part in ("768 B a token (48 MoE layers x top-8 expert ids, int16) in host memory",
                 "a sample 6.0 MiB at rollout.max_response_len = 8192 tokens", "up to 30.0 MiB at the model's "
                 "context of 40960", "2048 samples (128 prompts x 16, padded to the longest) 12.0 GiB, up to 60.0 GiB",
                 "(dp 8: 256 samples) 1.5 GiB, up to 7.5 GiB",
                 "(8 distinct share(s) among its 8 workers): 12.0 GiB, up to 60.0 GiB per node"):
        assert part in line, (part, line)
    _, one = check(registry, "qwen3-30b-a3b-8gpu", "actor.moe.routing_replay=rollout", "trainer.world_size=1",
                   "actor.parallel.ep=1", "rollout.tp=1")
    line = next(row for row in one.splitlines() if row.startswith("routes"))
    assert line.endswith("(dp 1: 2048 samples) 12.0 GiB, up to 60.0 GiB")      # one process: no copies
