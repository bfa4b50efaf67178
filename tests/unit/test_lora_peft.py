"""rlcore's LoRA factors in PEFT's layout (``rlcore.lora.peft``): per HF projection, W_hf + scale * lora_B lora_A
equals the HF conversion of the merged Megatron weight, for fused and plain rules at TP1 and TP2; and the keys,
shapes and config are those PEFT itself builds for the same HF model."""
import pytest
import torch

from rlcore.convert import Layout, Rename, WeightConverter, gated_mlp_rules, llama_style_rules
from rlcore.lora.peft import adapter_config, peft_factors, peft_state_dict, target_modules
from rlcore.lora.config import LoRAConfig
from rlcore.lora.layers import merge

LAYOUT = Layout(num_heads=4, num_query_groups=2, head_dim=8, vocab_size=64)
HIDDEN, FFN, RANK = 32, 48, 4
M = "decoder.layers.{layer}.mlp"
CONVERTER = WeightConverter(llama_style_rules(gated_mlp_rules(M, "model.layers.{layer}.mlp"), qkv_bias=False,
                                              tied=True), num_layers=2, layout=LAYOUT)
QKV_ROWS = (LAYOUT.num_heads + 2 * LAYOUT.num_query_groups) * LAYOUT.head_dim
# weight -> (full W shape, column-parallel)
ADAPTED = {
    "decoder.layers.1.self_attention.linear_qkv.weight": ((QKV_ROWS, HIDDEN), True),
    "decoder.layers.1.self_attention.linear_proj.weight": ((HIDDEN, LAYOUT.num_heads * LAYOUT.head_dim), False),
    "decoder.layers.1.mlp.linear_fc1.weight": ((2 * FFN, HIDDEN), True),
    "decoder.layers.1.mlp.linear_fc2.weight": ((HIDDEN, FFN), False),
}


def shards(t: torch.Tensor, dim: int, tp: int) -> list[torch.Tensor]:
    return list(t.chunk(tp, dim))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(ADAPTED))
def test_projection_adapters_merge_to_the_converted_merged_weight(name, tp):
    """The factors of each HF projection applied to the HF W give the merged Megatron weight's HF conversion: the
    fused adapter's rows (column) / columns (row) land where W's do, per TP shard as the weight sync gives them."""
    (out, inp), column = ADAPTED[name]
    g = torch.Generator().manual_seed(0)
    w_shards = shards(torch.randn(out, inp, generator=g), 0 if column else 1, tp)
    a_full, b_full = torch.randn(RANK, inp, generator=g), torch.randn(out, RANK, generator=g)
    # each rank's factors as its adapter holds them (column: A replicated, B split like W's rows; row: the reverse)
    a_shards = [a_full] * tp if column else shards(a_full, 1, tp)
    b_shards = shards(b_full, 0, tp) if column else [b_full] * tp
    scale = 2.0
    merged = dict(CONVERTER.to_hf(name, [merge(w, a, b, scale) for w, a, b in zip(w_shards, a_shards, b_shards)]))
    base = dict(CONVERTER.to_hf(name, w_shards))
    factors = peft_factors(CONVERTER, name, a_shards, b_shards, column)
    assert [f"{m}.weight" for m, _, _ in factors] == list(merged)
    for module, a, b in factors:
        assert a.shape[0] == RANK and b.shape[1] == RANK
        torch.testing.assert_close(base[f"{module}.weight"] + scale * b @ a, merged[f"{module}.weight"])
    if column and tp == 1 and "linear_qkv" in name:
        assert [m.rsplit(".", 1)[-1] for m, _, _ in factors] == ["q_proj", "k_proj", "v_proj"]


def test_keys_shapes_and_config_are_what_peft_builds():
    """PEFT, given our adapter_config for the same HF model, creates exactly our keys with our shapes."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf = LlamaConfig(vocab_size=LAYOUT.vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                     num_attention_heads=LAYOUT.num_heads, num_key_value_heads=LAYOUT.num_query_groups,
                     head_dim=LAYOUT.head_dim, tie_word_embeddings=True)
    ours: dict = {}
    for layer in range(2):
        for name, ((out, inp), column) in ADAPTED.items():
            name = name.replace("layers.1", f"layers.{layer}")
            ours |= peft_state_dict(peft_factors(CONVERTER, name, [torch.zeros(RANK, inp)], [torch.zeros(out, RANK)],
                                                 column))
    modules = {k.split(".lora_")[0][len("base_model.model."):] for k in ours}
    lora = LoRAConfig(rank=RANK, alpha=8)
    config = adapter_config(lora, target_modules(modules, CONVERTER.hf_names()), "some/base")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = get_peft_model(AutoModelForCausalLM.from_config(hf), LoraConfig(**config))
    theirs = get_peft_model_state_dict(peft_model)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == lora.scale


def test_target_modules_name_modules_in_full_when_a_short_name_is_shared():
    hf_names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight"]
    assert target_modules(["model.layers.0.mlp.gate_proj"], hf_names) == ["model.layers.0.mlp.gate_proj"]
    assert target_modules(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.shared_expert.gate_proj"],
                          hf_names) == ["gate_proj"]


def test_a_rule_naming_no_module_weight_is_refused_in_one_line():
    converter = WeightConverter([Rename("decoder.layers.{layer}.mlp.router.expert_bias", "model.layers.{layer}.bias")],
                                num_layers=1, layout=LAYOUT)
    with pytest.raises(ValueError) as e:
        peft_factors(converter, "decoder.layers.0.mlp.router.expert_bias", [torch.zeros(1, 2)], [torch.zeros(2, 1)],
                     column=True)
    assert "model.layers.0.bias" in str(e.value) and "\n" not in str(e.value)
