"""Qwen3 dense and Qwen3-MoE against transformers, with rlcore's model-plugin conformance checks: logits equal,
HF -> Megatron -> HF exact, TP-sharded rules exact, and (MoE) expert parallelism over two processes."""
import pytest

from rlcore.megatron.parallel import init_parallel
from rlcore_testing.models import (assert_expert_parallel, assert_logits_match, assert_round_trip_exact,
                            assert_tp_conversion_exact, build_megatron, tiny_checkpoint)
from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
from runs import torchrun

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)
FAMILIES = {"dense": QWEN3, "moe": QWEN3_MOE}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    spec = FAMILIES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = tiny_checkpoint(spec, path, **SIZES)
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
    assert assert_tp_conversion_exact(model, converter, path) > 0


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("family", ["moe"], indirect=True)      # the experts' test: the MoE family only
def test_expert_parallel_conversion(family):
    spec, path, _, _, _ = family
    assert_expert_parallel("qwen3", spec.name, path, ranks=torchrun)
