"""Mixtral against transformers, with rlcore's model-plugin conformance checks: logits equal, HF -> Megatron -> HF
exact, TP-sharded rules exact, and expert parallelism over two processes."""
import pytest

from rlcore.megatron.parallel import init_parallel
from rlcore_testing.models import (assert_expert_parallel, assert_logits_match, assert_round_trip_exact,
                            assert_tp_conversion_exact, build_megatron, tiny_checkpoint)
from rlcore_model_mixtral.plugin import MIXTRAL
from runs import torchrun

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


def test_router_jitter_noise_is_named_in_one_log_line(caplog):
    """transformers applies router_jitter_noise only in training: rlcore leaves it out and says so."""
    import logging

    hf = MIXTRAL.tiny_hf_config(vocab_size=48, **SIZES)
    with caplog.at_level(logging.INFO, logger="rlcore_model_mixtral.plugin"):
        MIXTRAL.transformer_config({**hf, "router_jitter_noise": 0.1})
        MIXTRAL.transformer_config(hf)
    assert [r.getMessage() for r in caplog.records] == [
        "Mixtral: router_jitter_noise=0.1 is not applied (transformers applies it only in training; rlcore trains "
        "without it, and generation never uses it)"]


@pytest.mark.slow
@pytest.mark.parallel
def test_expert_parallel_conversion(mixtral):
    assert_expert_parallel("mixtral", "mixtral", mixtral[0], ranks=torchrun)
