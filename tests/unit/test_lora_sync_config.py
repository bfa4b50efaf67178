"""``rollout.lora`` (merged | adapters) as a user sets it: a bad value, adapters without LoRA, a backend that does not
serve adapters (SGLang, the HF backend) and a checkpoint the engine cannot start from are each refused in one line
naming the key and what to do; and the pure parts of the adapters-only sync (vLLM's rank sizing, the push's
self-describing form)."""
import pytest
import torch

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.preflight import check_rollout_backend

LORA = ["actor.lora.rank=8", "rollout.lora=adapters"]
HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_merged_by_default():
    assert load_config("quickstart").rollout.lora == "merged"


def test_a_bad_value_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", ["actor.lora.rank=8", "rollout.lora=adapter"])
    assert "'rollout.lora' = 'adapter'" in one_line(e) and "merged or adapters" in str(e.value)


def test_adapters_need_lora_on_the_actor():
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", ["rollout.lora=adapters"])
    assert "rollout.lora = 'adapters' without actor.lora.rank" in one_line(e)
    assert "set actor.lora.rank" in str(e.value)


@pytest.fixture(scope="module")
def registry():
    return load_plugins(["qwen3", "vllm", "sglang", "hf"]).registry


@pytest.mark.parametrize("backend", ["sglang", "hf"])
def test_a_backend_without_adapters_is_refused_by_name(registry, backend):
    """SGLang 0.5.23 on CPU cannot start with LoRA at all (pin_memory=True in sglang/srt/lora/layers.py:
    'pin_memory=True requires a CUDA or other accelerator backend'), and rlcore's SGLang backend does not load
    adapters."""
    cfg = load_config("quickstart", [*LORA, f"rollout.backend={backend}"])
    for here in (True, False):      # a run and a dry run refuse alike
        with pytest.raises(ConfigError) as e:
            check_rollout_backend(cfg, registry, HF_CONFIG, here=here)
        assert f"rollout.lora = 'adapters' with rollout.backend = '{backend}'" in one_line(e)
        assert "use rollout.lora=merged" in str(e.value)


def test_vllm_serves_adapters(registry):
    check_rollout_backend(load_config("quickstart", LORA), registry, HF_CONFIG)


def test_a_quantized_checkpoint_is_refused(registry):
    """The engine starts weightless from a block-FP8 checkpoint (rlcore pushes the dequantized weights): no base
    weights for the adapters."""
    fp8 = {**HF_CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(ConfigError) as e:
        check_rollout_backend(load_config("quickstart", LORA), registry, fp8)
    assert "rollout.lora = 'adapters' with a quantized checkpoint" in one_line(e)


@pytest.mark.parametrize("rank, served", [(1, 1), (4, 8), (8, 8), (16, 16), (17, 32), (320, 320)])
def test_vllm_sizes_its_lora_buffers_for_the_smallest_rank_that_fits(rank, served):
    from rlcore_rollout_vllm.backend import _vllm_lora_rank

    assert _vllm_lora_rank(rank) == served


def test_vllm_refuses_a_rank_past_its_largest():
    from rlcore_rollout_vllm.backend import _vllm_lora_rank

    with pytest.raises(ValueError, match="actor.lora.rank = 600: vLLM serves LoRA adapters up to rank 512"):
        _vllm_lora_rank(600)


def test_a_pushed_adapter_carries_its_config():
    from rlcore.lora.sync import pushed, received

    tensors = {"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.randn(8, 16),
               "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.randn(4, 8)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]}
    got, got_config = received(pushed(tensors, config))
    assert got_config == config and list(got) == list(tensors)
    assert all(torch.equal(got[n], tensors[n]) for n in tensors)
    with pytest.raises(ValueError, match="disagree on rollout.lora"):
        received(iter(tensors.items()))


def test_a_converted_checkpoint_is_refused(tmp_path):
    """`rlcore convert`'s output holds Megatron weights, which the engine cannot start from (it starts weightless and
    the actor's weights are pushed to it): no base weights for the adapters."""
    from rlcore.converted import MARKER

    for name in ("config.json", "tokenizer.json", MARKER):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", [*LORA, f"model.path={tmp_path}"])
    assert "rollout.lora = 'adapters' with model.path" in one_line(e) and "a checkpoint `rlcore convert` wrote" in \
        str(e.value)
