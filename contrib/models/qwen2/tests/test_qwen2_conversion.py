"""Qwen2 dense (tied and untied embeddings) and Qwen2-MoE against transformers, with rlcore's model-plugin
conformance checks: logits equal, HF -> Megatron -> HF exact, TP-sharded rules exact (the QKV bias split by whole
query groups like the fused QKV weight), and (MoE) expert parallelism over two processes."""
import pytest

from rlcore.megatron.parallel import init_parallel
from rlcore_testing.models import (assert_expert_parallel, assert_logits_match, assert_round_trip_exact,
                            assert_tp_conversion_exact, build_megatron, tiny_checkpoint)
from rlcore_model_qwen2.plugin import QWEN2, QWEN2_MOE
from runs import torchrun

SIZES = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)
FAMILIES = {"dense": (QWEN2, {}), "dense-tied": (QWEN2, {"tie_word_embeddings": True}), "moe": (QWEN2_MOE, {})}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    spec, overrides = FAMILIES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = tiny_checkpoint(spec, path, hf_overrides=overrides, **SIZES)
    init_parallel(seed=0)
    model, converter = build_megatron(spec, path)
    return spec, path, hf_model, model, converter


def test_megatron_logits_equal_transformers(family):
    _, _, hf_model, model, _ = family
    assert_logits_match(model, hf_model, vocab_size=48)


def test_round_trip_is_exact(family):
    _, path, _, model, converter = family
    assert_round_trip_exact(model, converter, path)


def test_tp_sharded_conversion_equals_unsharded(family):
    _, path, _, model, converter = family
    checked = assert_tp_conversion_exact(model, converter, path)
    biases = [n for n, _ in model.named_parameters() if n.endswith("linear_qkv.bias")]
    assert len(biases) == SIZES["num_layers"] and checked > len(biases)


@pytest.mark.parametrize("family", ["moe"], indirect=True)      # the shared expert's test: the MoE family only
def test_shared_expert_gate_is_megatrons_sigmoid_gate(family):
    """HF: sigmoid(shared_expert_gate(x)) * shared_expert(x); megatron-core's gated shared expert, checked on the
    module itself (the logits test checks it inside the model)."""
    import torch

    spec, _, hf_model, model, _ = family
    assert spec is QWEN2_MOE
    x = torch.randn(5, 1, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
    ours = model.decoder.layers[0].mlp.shared_experts(x)
    block = hf_model.model.layers[0].mlp
    with torch.no_grad():
        theirs = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert (ours - theirs).abs().max().item() < 1e-6


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("family", ["moe"], indirect=True)      # the experts' test: the MoE family only
def test_expert_parallel_conversion(family):
    spec, path, _, _, _ = family
    assert_expert_parallel("qwen2", spec.name, path, ranks=torchrun)


def test_tiny_sizes_qwen2_cannot_have_are_one_config_error():
    """`rlcore run model.family=qwen2 model.tiny.hidden_size=64` (head_dim 32, 4 heads): one line, no traceback."""
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.tiny: .* head_dim=32 does not go with hidden_size=64, num_heads=4"):
        QWEN2.tiny_hf_config(vocab_size=48, **{**SIZES, "num_heads": 4})
