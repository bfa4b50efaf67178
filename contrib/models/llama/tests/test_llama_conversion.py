"""Llama 3.x against transformers, with rlcore's model-plugin conformance checks (logits equal, HF -> Megatron -> HF
exact, TP-sharded rules exact; untied as 3.1-8B, tied as 3.2-1B/3B), and the llama3 RoPE scaling: megatron-core's
inverse frequencies equal transformers' for the published Llama-3.1-8B and Llama-3.2-1B configs."""
import pytest
import torch

from rlcore.megatron.parallel import init_parallel
from rlcore_testing.models import (assert_logits_match, assert_round_trip_exact, assert_tp_conversion_exact,
                                   build_megatron, published_config, tiny_checkpoint)
from rlcore_model_llama.plugin import LLAMA

SIZES = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, ffn_hidden_size=96,
             max_position_embeddings=32)


@pytest.fixture(scope="module", params=["untied", "tied"])
def llama(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = tiny_checkpoint(LLAMA, path, hf_overrides={"tie_word_embeddings": request.param == "tied"}, **SIZES)
    init_parallel(seed=0)
    model, converter = build_megatron(LLAMA, path)
    return path, hf_model, model, converter


def test_megatron_logits_equal_transformers(llama):
    _, hf_model, model, _ = llama
    assert_logits_match(model, hf_model, vocab_size=48)


def test_round_trip_is_exact(llama):
    path, _, model, converter = llama
    assert_round_trip_exact(model, converter, path)


def test_tp_sharded_conversion_equals_unsharded(llama):
    path, _, model, converter = llama
    assert assert_tp_conversion_exact(model, converter, path) > 0


def test_tiny_model_runs_llama3_scaled_rope(llama):
    _, hf_model, model, _ = llama
    ours, theirs = model.rotary_pos_emb.inv_freq, hf_model.model.rotary_emb.inv_freq
    assert torch.equal(ours, theirs.to(ours.dtype))
    assert not torch.equal(ours, 1.0 / 500000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))   # scaled


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_rope_scaling_equals_transformers_on_published_configs(name):
    """Full head_dim (128 / 64), base 5e5, factor 8 / 32: every band (kept, interpolated, divided) is populated."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rlcore.hf_config import with_transformers_defaults
    from rlcore_model_llama.plugin import gpt_kwargs

    published = published_config(name)
    hf = with_transformers_defaults(published)
    kwargs = gpt_kwargs(hf)
    assert kwargs["rope_scaling"] and kwargs["rope_scaling_factor"] == published["rope_scaling"]["factor"]
    ours = RotaryEmbedding(kv_channels=hf["head_dim"], rotary_percent=1.0, rotary_base=kwargs["rotary_base"],
                           rope_scaling=True, rope_scaling_factor=kwargs["rope_scaling_factor"],
                           use_cpu_initialization=True).inv_freq
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**published), "cpu")
    assert attention_factor == 1.0
    assert torch.equal(ours, theirs.float())
    wavelength = 2 * torch.pi / (1.0 / kwargs["rotary_base"] ** (torch.arange(0, hf["head_dim"], 2) / hf["head_dim"]))
    assert (wavelength < 8192 / 4).any() and (wavelength > 8192).any() and \
        ((wavelength > 8192 / 4) & (wavelength < 8192)).any()
