"""``actor.lora`` as a user sets it: bad values are one line naming the key, and ``--dry-run`` reports adapter-only
gradients and optimizer state (no reference copy), MoE experts' adapters counted per EP rank."""
import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.dry_run import dry_run


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.rank=-1"], "actor.lora.rank=-1: must be a positive integer"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha=0.0: must be positive"),
    (["actor.lora.rank=8", "actor.lora.dropout=1"], "actor.lora.dropout=1.0: must be in [0, 1)"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[router]"], "the MoE router is never adapted"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[linear_qkvv]"], "choose from linear_qkv, linear_proj"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_off_by_default():
    assert load_config("quickstart").actor.lora.rank == 0


@pytest.fixture(scope="module")
def registry():
    return load_plugins(["qwen3"]).registry


def report(registry, preset, *overrides):
    cfg = load_config(preset, list(overrides))
    return dry_run(cfg, registry.get("models", cfg.model.family), reference=True)


def per_device(text):
    line = next(line for line in text.splitlines() if line.startswith("per device"))
    return {k: float(line.split(f"{k} ")[1].split(" GiB")[0]) for k in ("params", "grads", "optimizer")}


def test_dry_run_counts_adapters_only(registry):
    _, full = report(registry, "qwen3-8b-gsm8k-8gpu")
    problems, lora = report(registry, "qwen3-8b-gsm8k-8gpu", "actor.lora.rank=16")
    assert not problems
    print(full, lora, sep="\n")
    f, a = per_device(full), per_device(lora)
    assert a["grads"] < 0.01 * f["grads"] and a["optimizer"] < 0.02 * f["optimizer"]
    assert a["params"] >= f["params"]                              # the base weights stay, adapters on top
    assert "reference  " in full and "reference  " not in lora     # no frozen copy: adapters off instead
    assert "lora       rank 16" in lora


def adapter_millions(text):
    line = next(line for line in text.splitlines() if line.startswith("lora "))
    return float(line.split(": ")[1].split("M adapter parameters")[0])


def test_dry_run_counts_expert_adapters_per_ep_rank(registry):
    """Qwen3-30B-A3B at EP8: linear_fc1/fc2 adapt each of an EP rank's 16 routed experts (48 layers, hidden 2048,
    expert FFN 768, rank 16: 16 x 48 x 16 x (2048 + 2 x 768 + 768 + 2048) = 78.6M) on top of the attention's."""
    problems, everything = report(registry, "qwen3-30b-a3b-8gpu", "actor.lora.rank=16")
    assert not problems, problems
    _, attention = report(registry, "qwen3-30b-a3b-8gpu", "actor.lora.rank=16",
                          "actor.lora.target_modules=[linear_qkv,linear_proj]")
    experts = 16 * 48 * 16 * (2048 + 2 * 768 + 768 + 2048) / 1e6
    assert abs(adapter_millions(everything) - adapter_millions(attention) - experts) <= 0.1, everything


def test_dry_run_sizes_adapters_on_multi_latent_attention():
    """DeepSeek-V3's attention projections (query compression: down/up, no linear_q_proj) take adapters; a name its
    attention lacks is refused, listing the ones it has."""
    registry = load_plugins(["deepseek"]).registry
    mla = "[linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,linear_proj]"
    cfg = load_config("deepseek-v3-671b-128gpu", ["actor.lora.rank=16", f"actor.lora.target_modules={mla}"])
    problems, text = dry_run(cfg, registry.get("models", cfg.model.family), reference=True)
    assert not problems, problems
    assert "lora       rank 16 on linear_q_down_proj" in text and per_device(text)["grads"] < 0.1
    cfg = load_config("deepseek-v3-671b-128gpu", ["actor.lora.rank=16", "actor.lora.target_modules=[linear_q_proj]"])
    problems, _ = dry_run(cfg, registry.get("models", cfg.model.family), reference=True)
    assert problems == ["actor.lora.target_modules names linear_q_proj, which this model's attention does not have; "
                        "its linears are linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, "
                        "linear_proj"], problems
