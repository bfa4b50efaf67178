"""Routed experts from SGLang (routing replay, ``actor.moe.routing_replay=rollout``): an engine started with
``routed_experts=True`` returns, per completion, the experts each MoE layer of a tiny Qwen3-MoE routed every token
fed to (prompt + response[:-1]), equal to transformers' routers on the same tokens."""
import asyncio
import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (contrib/rollout/sglang/requirements-sglang.txt)", allow_module_level=True)

import torch

from rlcore.specs import Sampling

pytestmark = [pytest.mark.slow]

EXPERTS, TOP_K, LAYERS = 8, 2, 3
SHARE = 0.99    # of (token, layer) pairs equal to transformers' (fp32 both: measured 1.0)


def hf_routes(model, sequence: list[int]) -> torch.Tensor:
    """transformers' top-k expert ids per token and layer [len(sequence), layers, top_k], each row ascending: the
    third output of every ``Qwen3MoeTopKRouter`` (logits, scores, indices) in a forward of ``sequence`` alone."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    fired: list[torch.Tensor] = []
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    handles = [r.register_forward_hook(lambda module, args, out: fired.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([sequence]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(fired, 1).sort(-1).values


def test_routes_equal_transformers_routers(tmp_path):
    from rlcore.config.schema import RolloutConfig
    from rlcore.plugins import load_plugins
    from rlcore_testing.contract import write_word_tokenizer
    from rlcore_testing.models import write_checkpoint

    registry = load_plugins(["qwen3", "sglang"]).registry
    hf = registry.get("models", "qwen3_moe").tiny_hf_config(
        vocab_size=64, hidden_size=64, num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=32,
        ffn_hidden_size=128, max_position_embeddings=256, num_experts=EXPERTS, experts_per_token=TOP_K)
    reference = write_checkpoint(hf, str(tmp_path))
    write_word_tokenizer(str(tmp_path), hf["vocab_size"], hf["eos_token_id"])
    spec = registry.get("rollout_backends", "sglang")
    assert torch.device("cpu").type in spec.routed_experts
    engine = spec.factory(str(tmp_path), RolloutConfig(backend="sglang", kv_cache_gib=0.01, tp=1), seed=0,
                          max_model_len=128, routed_experts=True)
    prompts = [[7, 3, 11, 5, 2, 9, 4], [12, 40], [5] * 20, [33, 1, 8, 60, 21]]

    async def sample():
        aborted = asyncio.ensure_future(engine.generate([9, 9, 2], Sampling(100, 1.0), None, "long"))
        done = await asyncio.gather(*(engine.generate(p, Sampling(12, 1.0), None, f"r{i}-{j}")
                                      for i, p in enumerate(prompts) for j in range(2)))
        engine.abort("long")
        return [p for p in prompts for _ in range(2)] + [[9, 9, 2]], done + [await aborted]

    try:
        asked, completions = asyncio.new_event_loop().run_until_complete(sample())
    finally:
        engine.stop()
    assert completions[-1].finish_reason == "abort" and 0 < len(completions[-1].tokens) < 100, completions[-1]
    same = pairs = 0
    for prompt, gen in zip(asked, completions):
        routes, n = gen.routed_experts, len(prompt) + len(gen.tokens) - 1
        assert routes.dtype == torch.int16 and tuple(routes.shape) == (n, LAYERS, TOP_K), (gen.request_id, routes)
        assert (routes[..., 1:] > routes[..., :-1]).all() and ((routes >= 0) & (routes < EXPERTS)).all()
        equal = (routes == hf_routes(reference, (prompt + gen.tokens)[:n])).all(-1)
        same, pairs = same + int(equal.sum()), pairs + equal.numel()
    print(f"SGLang's routes equal transformers' for {same} of {pairs} (token, layer) pairs ({same / pairs:.4%}), "
          f"{len(completions)} completions (one aborted after {len(completions[-1].tokens)} tokens)")
    assert same / pairs >= SHARE
