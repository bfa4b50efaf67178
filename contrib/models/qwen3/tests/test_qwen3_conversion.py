"""Qwen3 HF <-> Megatron: exact round trip, logits equal to transformers', and TP-sharded rules equal to TP=1."""
import pytest
import torch
from safetensors.torch import load_file

from rlcore.engine.reshard import Resharder
from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
from rlcore.megatron.parallel import init_parallel
from rlcore_model_qwen3.plugin import QWEN3

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 saved by transformers, with norms randomised so that mapping mistakes show."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3.tiny_hf_config(vocab_size=48, **SIZES))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path), model.eval()


@pytest.fixture(scope="module")
def megatron_model(hf_checkpoint):
    path, _ = hf_checkpoint
    init_parallel(seed=0)
    model, converter = build_gpt(QWEN3, read_hf_config(path))
    load_hf_into(model, converter, read_hf_weights(path))
    return model.eval(), converter


def test_round_trip_is_exact(hf_checkpoint, megatron_model):
    path, _ = hf_checkpoint
    on_disk = load_file(f"{path}/model.safetensors")
    exported = dict(Resharder(*megatron_model).stream())
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def test_megatron_logits_equal_transformers(hf_checkpoint, megatron_model):
    _, hf = hf_checkpoint
    model, _ = megatron_model
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(ids, positions, None)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("tp", [2])
def test_tp_sharded_conversion_equals_unsharded(hf_checkpoint, megatron_model, tp):
    """from_hf at every TP rank, then to_hf of the shards, gives back the HF tensors (incl. fused qkv / gate-up)."""
    path, _ = hf_checkpoint
    model, converter = megatron_model
    hf = read_hf_weights(path)
    for name, full in model.named_parameters():
        rule = converter.rule(name)
        dim = getattr(rule, "tp_dim", 0)
        if dim is None:
            continue
        shape = list(full.shape)
        shape[dim] //= tp
        shards = [rule.from_hf(hf, converter.layout, r, tp, torch.Size(shape)) for r in range(tp)]
        assert all(s.shape == torch.Size(shape) for s in shards), name
        for hf_name, tensor in rule.to_hf(shards, converter.layout):
            assert torch.equal(tensor, hf[hf_name]), (name, hf_name, tp)
