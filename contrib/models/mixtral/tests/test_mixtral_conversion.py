"""Mixtral against transformers, with rlcore's model-plugin conformance checks: logits equal, HF -> Megatron -> HF
exact, TP-sharded rules exact, and expert parallelism over two processes."""
import pytest

from rlcore.megatron.parallel import init_parallel
from rlcore.testing import (assert_expert_parallel, assert_logits_match, assert_round_trip_exact,
                            assert_tp_conversion_exact, build_megatron, tiny_checkpoint)
from rlcore_model_mixtral.plugin import MIXTRAL

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mixtral"))
    hf_model = tiny_checkpoint(MIXTRAL, path, **SIZES)
    init_parallel(seed=0)
    model, converter = build_megatron(MIXTRAL, path)
    return path, hf_model, model, converter


def test_megatron_logits_equal_transformers(mixtral):
    _, hf_model, model, _ = mixtral
    assert_logits_match(model, hf_model, vocab_size=48)


def test_round_trip_is_exact(mixtral):
    path, _, model, converter = mixtral
    assert_round_trip_exact(model, converter, path)


def test_tp_sharded_conversion_equals_unsharded(mixtral):
    path, _, model, converter = mixtral
    assert assert_tp_conversion_exact(model, converter, path) > 0


def test_sliding_window_is_refused():
    hf = MIXTRAL.tiny_hf_config(vocab_size=48, **SIZES)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        MIXTRAL.transformer_config({**hf, "sliding_window": 4096})


@pytest.mark.slow
@pytest.mark.parallel
def test_expert_parallel_conversion(mixtral):
    assert_expert_parallel("mixtral", "mixtral", mixtral[0], port=29683)
