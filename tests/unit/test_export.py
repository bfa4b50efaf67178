"""The export's reader: HF weights streamed out of a distributed checkpoint a bucket at a time, with only the model's
structure built (on the meta device), equal to the HF checkpoint the model was loaded from, for every family's
layout in megatron-core's checkpoint (stacked layers and experts, gated fc1 halves, MLA, the expert-bias buffer)."""
import pytest
import torch

from rlcore.megatron.model import read_hf_config, read_hf_weights
from rlcore.megatron.parallel import init_parallel
from rlcore_testing.models import tiny_checkpoint

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=64,
             max_position_embeddings=32)


def _registry():
    from rlcore.plugins import load_plugins

    return load_plugins(["qwen3", "mixtral", "deepseek"]).registry


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_weights_read_from_a_checkpoint_equal_the_hf_checkpoint(family, tmp_path):
    from rlcore.config.schema import ActorConfig
    from rlcore.export import checkpoint_hf_weights
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import save_model

    registry = _registry()
    spec = registry.get("models", family)
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    tiny_checkpoint(spec, hf_dir, **SIZES)
    init_parallel(seed=0)
    actor = MegatronActor(spec, read_hf_config(hf_dir), ActorConfig(), registry.get("optimizers", "adam"),
                          hf_state=read_hf_weights(hf_dir))
    save_model(actor, ckpt)
    del actor
    specs, stream = checkpoint_hf_weights(ckpt, spec, read_hf_config(hf_dir), "float32", bucket_bytes=16 << 10)
    got = {name: t.clone() for name, t in stream}
    on_disk = read_hf_weights(hf_dir)
    assert [s.name for s in specs] == list(got), "the stream follows its plan"
    assert sorted(got) == sorted(on_disk)
    for name in on_disk:
        assert torch.equal(got[name], on_disk[name]), name


def test_a_lora_checkpoints_missing_or_other_base_is_one_line_naming_it(tmp_path):
    """A LoRA checkpoint holds the adapters only: its merged export refuses a base directory that is gone, or whose
    weight files differ from those the run fingerprinted, saying to pass --base."""
    from safetensors.torch import save_file

    from rlcore.lora.base import base_fingerprint
    from rlcore.errors import ConfigError
    from rlcore.export import lora_base

    gone = {"model": {"path": str(tmp_path / "gone")}}
    with pytest.raises(ConfigError) as e:
        lora_base("ckpt", gone, None)
    assert "gone" in str(e.value) and "--base" in str(e.value) and "\n" not in str(e.value)
    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(4)}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    trained_on = base_fingerprint(str(base))
    save_file({"w": torch.ones(4)}, str(base / "model.safetensors"))     # another base, same names and sizes
    with pytest.raises(ConfigError) as e:
        lora_base("ckpt", {"model": {"path": str(base), "base": trained_on}}, None)
    assert "model.safetensors differ" in str(e.value) and "--base" in str(e.value) and "\n" not in str(e.value)
    assert lora_base("ckpt", {"model": {}}, None) is None     # older checkpoints hold their base weights
