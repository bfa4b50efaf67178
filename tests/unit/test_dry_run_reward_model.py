"""`rlcore run --dry-run` with a reward model: its config (reward_model.path's config.json, or reward_model.hf_config,
a path or a config bundled in configs/models, as model.hf_config) is checked as the run checks it, its layout
against its own world with the actor's layout checks (refusals name the reward_model.* key), and its memory per
device reported: parameters only (forward only), the [1, hidden] score head in the vocabulary projection's place,
on the device between its passes or not as reward_model.offload.params says. The 671B preset validates with a
Llama-3.1-70B sequence classifier; at a tiny size the estimate is what a built MegatronRewardModel holds."""
import sys

import pytest

from rlcore.config import load_config
from rlcore.config.schema import Config, ParallelConfig, RewardModelConfig, TrainerConfig
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.dry_run import dry_run
from rlcore.sizing import GIB

from runs import run_cli

PRESET = "deepseek-v3-671b-128gpu"
RM = "llama-3.1-70b-sequence-classifier"          # configs/models: Llama-3.1-70B's config as a sequence classifier
PLUGINS = ["deepseek", "grpo", "vllm", "llama"]    # the preset's, and the reward model's family
WITH_RM = [f"reward_model.hf_config={RM}", "reward_model.dtype=bfloat16", "reward_model.parallel.tp=8",
           "reward_model.parallel.pp=2", "reward_model.offload.params=true"]
# Llama-3.1-70B as published: 70,553,706,496 parameters; as a classifier its [vocab, hidden] output layer is a
# [1, hidden] score head
RM_PARAMS = 70_553_706_496 - 128256 * 8192 + 8192


@pytest.fixture(scope="module")
def registry():
    return load_plugins(PLUGINS).registry


def plan(registry, *overrides):
    cfg = load_config(PRESET, [*WITH_RM, *overrides])
    return dry_run(cfg, registry.get("models", cfg.model.family), models=registry.models)


def test_the_671b_preset_with_a_70b_reward_model_validates(registry, capsys):
    from rlcore.dry_run import command as cli_dry_run

    assert cli_dry_run(load_config(PRESET, WITH_RM), load_plugins(PLUGINS)) == 0
    report = capsys.readouterr().out
    assert "671.0B parameters" in report          # the actor's plan, unchanged
    assert (f"reward     llama sequence classifier (reward_model.hf_config {RM}): {RM_PARAMS / 1e9:.1f}B parameters, "
            f"80 layers, score head [1, 8192] in place of the vocabulary projection; forward only") in report
    assert ("world 128 = tp 8 x pp 2 x cp 1 x dp 8; layers split evenly; its own 128 processes, one per device of "
            "the actor's 128 (colocated: the same devices)") in report
    # the busiest stage is the first: the embedding and 40 of 80 layers, over TP 8, in bf16
    layer = 8192 * (64 + 2 * 8) * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    first = (128256 * 8192 + 40 * layer) / 8 * 2
    assert (f"per device params {first / GIB:.1f} GiB (bfloat16, busiest stage; no gradients, no optimizer state): "
            f"on the device only while it scores (reward_model.offload.params=true); between its passes on the "
            f"host, {first * 8 / GIB:.0f} GiB per node") in report


def test_the_reward_model_is_counted_in_its_own_layout(registry):
    from rlcore.megatron.model import transformer_config
    from rlcore.megatron.reward_model import family_of
    from rlcore.reward_model_sizing import read_reward_model_config, reward_model_estimate

    def estimate(*overrides):
        cfg = load_config(PRESET, [*WITH_RM, *overrides])
        hf = read_reward_model_config(cfg)
        return reward_model_estimate(transformer_config(family_of(registry.models, hf), hf, "bfloat16"), hf, cfg)

    pp2, pp1, fp32 = estimate(), estimate("reward_model.parallel.pp=1"), estimate("reward_model.dtype=float32")
    assert pp2["total_params"] == pp1["total_params"] == RM_PARAMS
    assert pp1["params"] == RM_PARAMS / 8 * 2 and pp1["dp"] == 16 and pp2["dp"] == 8
    assert fp32["params"] == 2 * pp2["params"]
    kept = estimate("reward_model.offload.params=false")
    assert kept["params"] == pp2["params"] and kept["cpu_per_node"] == 0 and pp2["cpu_per_node"] == 8 * pp2["params"]
    # async: as many processes as the rollout workers, unless reward_model.world_size says
    assert estimate("trainer.mode=async", "rollout.world_size=32", "rollout.tp=32")["dp"] == 2
    assert estimate("reward_model.world_size=16", "reward_model.parallel.pp=1")["dp"] == 2


def test_kept_on_the_device_it_adds_to_the_actor(registry):
    _, report = plan(registry, "reward_model.offload.params=false")
    actor = float(report.split("per device params ")[1].split("= ")[1].split(" GiB")[0])
    rm = float(report.split("per device params ")[2].split(" GiB")[0])
    assert (f"kept on the device between its passes (reward_model.offload.params=false): with the actor's, "
            f"{actor + rm:.1f} GiB per device") in report


@pytest.mark.parametrize("overrides, expected", [
    (["reward_model.parallel.tp=4", "reward_model.parallel.pp=32"],
     "80 layers do not split evenly over reward_model.parallel.pp = 32 stages"),
    (["reward_model.parallel.pp=16", "reward_model.parallel.last_stage_layers=6"],
     "reward_model.parallel.last_stage_layers = 6 leaves 74 of 80 layers for 15 stages"),
    (["reward_model.parallel.tp=16", "reward_model.parallel.pp=1"],
     "query groups (KV heads) = 8 is not divisible by reward_model.parallel.tp = 16"),
])
def test_a_reward_model_layout_that_does_not_fit_is_refused(registry, overrides, expected):
    problems, report = plan(registry, *overrides)
    assert [p for p in problems if expected in p] and not report, problems
    assert all("reward_model.parallel" in p for p in problems), problems     # the actor's layout fits


@pytest.mark.parametrize("overrides, expected", [
    (["reward_model.parallel.pp=3"], "trainer.world_size = 128 is not a multiple of reward_model.parallel.tp x pp x "
                                     "cp = 8 x 3 x 1"),
    (["reward_model.world_size=8", "reward_model.parallel.pp=2"], "reward_model.world_size = 8 is not a multiple of "
                                                                  "reward_model.parallel.tp x pp x cp = 8 x 2 x 1"),
    (["reward_model.parallel.tp=1", "reward_model.parallel.pp=1", "reward_model.parallel.sp=true"],
     "reward_model.parallel.sp = true needs reward_model.parallel.tp > 1"),
    (["reward_model.hf_config=llama-3.1-8b"], "reward_model.hf_config 'llama-3.1-8b': it holds a LlamaForCausalLM "
                                              "checkpoint, a causal LM"),
])
def test_a_reward_model_its_world_or_family_cannot_take_is_refused_in_one_line(registry, overrides, expected):
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")) as e:
        plan(registry, *overrides)
    assert "\n" not in str(e.value)


def test_cli_dry_run_prints_the_reward_model_and_refuses_its_layout():
    base = [sys.executable, "-m", "rlcore.cli", "run", "--dry-run", f"--plugins={','.join(PLUGINS)}", PRESET, *WITH_RM]
    ok = run_cli(base, timeout=180)
    assert ok.returncode == 0 and "reward     llama sequence classifier" in ok.stdout, ok.stderr[-2000:]
    bad = run_cli([*base, "reward_model.parallel.tp=16", "reward_model.parallel.pp=1"], timeout=180)
    assert bad.returncode == 2 and ("  - query groups (KV heads) = 8 is not divisible by reward_model.parallel.tp = 16"
                                    in bad.stderr), bad.stderr[-2000:]
    # without the reward model's family loaded: one line naming the key
    none = run_cli([*base[:5], "--plugins=deepseek,grpo,vllm", PRESET, *WITH_RM], timeout=180)
    assert none.returncode == 2 and none.stderr.startswith(f"rlcore: error: reward_model.hf_config '{RM}': it holds a "
                                                           "LlamaForSequenceClassification checkpoint, not a sequence "
                                                           "classifier of a model family"), none.stderr[-2000:]
    assert len(none.stderr.strip().splitlines()) == 1


def test_without_models_or_a_reward_model_nothing_changes(registry):
    cfg = load_config(PRESET, WITH_RM)
    _, without_models = dry_run(cfg, registry.get("models", "deepseek_v3"))
    plain = load_config(PRESET, [])
    _, without_rm = dry_run(plain, registry.get("models", "deepseek_v3"), models=registry.models)
    assert "reward " not in without_models and without_models == without_rm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_estimate_is_what_a_built_reward_model_holds(dtype):
    """The bundled 70B classifier's config scaled down, built in this process (world 1) as the reward model's
    workers build it: the bytes of its parameters are the estimate's (bf16: the norms are fp32, a few hundred
    bytes the estimate counts as bf16)."""
    from rlcore.hf_config import with_transformers_defaults
    from rlcore.megatron.model import transformer_config
    from rlcore.megatron.reward_model import MegatronRewardModel, family_of
    from rlcore.reward_model_sizing import reward_model_estimate
    from rlcore_testing.models import published_config

    hf = with_transformers_defaults(published_config(
        RM, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=256, max_position_embeddings=64, pad_token_id=255))   # as read_hf_config
    spec = family_of(load_plugins(["llama"]).registry.models, hf)
    cfg = Config(reward_model=RewardModelConfig(hf_config="tiny", dtype=dtype, parallel=ParallelConfig()),
                 trainer=TrainerConfig(world_size=1))
    model = MegatronRewardModel(spec, hf, cfg.reward_model, None, hf_state=None)
    params = list(model.model.parameters())
    held = sum(p.numel() * p.element_size() for p in params)
    norms = sum(p.numel() for n, p in model.model.named_parameters() if "norm" in n or "layernorm" in n)
    estimated = reward_model_estimate(transformer_config(spec, hf, dtype), hf, cfg)
    assert estimated["total_params"] == sum(p.numel() for p in params)
    assert estimated["params"] == held - (norms * 2 if dtype == "bfloat16" else 0), (estimated["params"], held)
    assert not any(p.requires_grad for p in params) and model.optimizer is None     # no gradients, no optimizer
    assert model._memory("grads") == [] and model._memory("optimizer") == []


def test_a_checkpoint_directory_is_read_and_checked_as_the_run_checks_it(registry, tmp_path):
    """reward_model.path: its config.json sizes the plan, and its files are checked as the run checks them before
    any worker starts (``check_reward_model``: the score head is there and one score wide)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlcore_testing.models import published_config

    hf = published_config(RM, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                          head_dim=8, intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                          pad_token_id=255)
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf), dtype=torch.float32).save_pretrained(
        tmp_path / "rm")
    problems, report = plan(registry, f"reward_model.path={tmp_path / 'rm'}", "reward_model.hf_config=ignored")
    assert not problems and f"(reward_model.path {tmp_path / 'rm'}): 0.0B parameters, 2 layers" in report
    hf["id2label"], hf["label2id"] = {"0": "LABEL_0", "1": "LABEL_1"}, {"LABEL_0": 0, "LABEL_1": 1}
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf), dtype=torch.float32).save_pretrained(
        tmp_path / "two")
    with pytest.raises(ConfigError, match=f"reward_model.path '{tmp_path / 'two'}': its score head is 2 labels wide"):
        plan(registry, f"reward_model.path={tmp_path / 'two'}")


def test_a_generative_judge_is_not_planned_as_a_megatron_model():
    from rlcore.reward_model_sizing import read_reward_model_config

    judge = load_config(PRESET, [f"reward_model.hf_config={RM}"])
    judge.reward_model.kind = "generative"          # it runs on an engine of its own, not on Megatron workers
    assert read_reward_model_config(judge) is None
    assert read_reward_model_config(load_config(PRESET, [f"reward_model.hf_config={RM}"])) is not None
