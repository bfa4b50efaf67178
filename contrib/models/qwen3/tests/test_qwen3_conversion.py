"""Qwen3 dense and Qwen3-MoE, HF <-> Megatron: exact round trip (against the file transformers wrote), logits equal
to transformers', and TP-sharded rules equal to TP=1."""
import pytest
import torch
from safetensors.torch import load_file

from rlcore.engine.reshard import Resharder
from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
from rlcore.megatron.parallel import init_parallel
from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)
FAMILIES = {"dense": (QWEN3, "Qwen3Config", "Qwen3ForCausalLM"),
            "moe": (QWEN3_MOE, "Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """A tiny random checkpoint saved by transformers (norms and router randomised so that mapping mistakes
    show), and the Megatron model loaded from it."""
    import transformers

    spec, config_cls, model_cls = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**spec.tiny_hf_config(vocab_size=48, **SIZES))
    hf = getattr(transformers, model_cls)(hf_config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)   # a decisive router: a wrong expert mapping changes the logits
    hf.save_pretrained(path)
    init_parallel(seed=0)
    model, converter = build_gpt(spec, read_hf_config(str(path)))
    load_hf_into(model, converter, read_hf_weights(str(path)))
    return str(path), hf.eval(), model.eval(), converter


def test_round_trip_is_exact(family):
    """transformers 5 keeps MoE experts fused in memory but writes them per expert: compare with the file."""
    path, _, model, converter = family
    on_disk = load_file(f"{path}/model.safetensors")
    exported = dict(Resharder(model, converter).stream())
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def test_megatron_logits_equal_transformers(family):
    _, hf, model, _ = family
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(ids, positions, None)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def test_tp_sharded_conversion_equals_unsharded(family):
    """from_hf at every TP rank, then to_hf of the shards, gives back the HF tensors (incl. fused qkv / gate-up)."""
    path, _, model, converter = family
    tp = 2
    hf = read_hf_weights(path)
    for name, full in model.named_parameters():
        rule = converter.rule(name)
        dim = getattr(rule, "tp_dim", 0)
        if dim is None or "local_experts" in name:   # replicated, or whole experts (no expert TP)
            continue
        shape = list(full.shape)
        shape[dim] //= tp
        shards = [rule.from_hf(hf, converter.layout, r, tp, torch.Size(shape)) for r in range(tp)]
        assert all(s.shape == torch.Size(shape) for s in shards), name
        for hf_name, tensor in rule.to_hf(shards, converter.layout):
            assert torch.equal(tensor, hf[hf_name]), (name, hf_name)
