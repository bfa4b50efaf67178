"""The rollout contract's routed-experts check (routing replay, ``actor.moe.routing_replay=rollout``), on a contract of
its own: a tiny MoE model's, the engine started with ``routed_experts=True`` (``RolloutContract`` builds one per
model of its ``routed_experts_models``). Each token fed needs its route, in layer order, from the forward that
sampled the next token, equal to transformers' routers on the same tokens."""
from __future__ import annotations

import asyncio
import re
from typing import Callable, Sequence

import torch

from rlcore.rollout.requests import run
from rlcore.routed_experts import DTYPE as ROUTES_DTYPE
from rlcore.specs import Completion, Sampling
from rlcore_testing.contract import (LOGPROB_TOLERANCE, LONG_TOKENS, MAX_TOKENS, Contract, Factory,
                                     greedy_continuation, write_word_tokenizer)
from rlcore_testing.rollout import checkpoint_weights

MOE_MODELS: dict[str, tuple[str, str, dict]] = {    # name: (plugin, model family, tiny_hf_config's sizes)
    "qwen3_moe": ("qwen3", "qwen3_moe", {}),
    "mixtral": ("mixtral", "mixtral", {}),
    "deepseek_v3": ("deepseek", "deepseek_v3", {"num_layers": 3}),     # layer 0 dense (first_k_dense_replace=1)
}
_MOE_SIZES = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  ffn_hidden_size=128, max_position_embeddings=256, num_experts=8, experts_per_token=2)
_ROUTER = re.compile(r"Top[kK]Router$")     # transformers' MoE routers: forward returns the top-k ids last


ROUTE_PROMPTS = [[7, 3, 11, 5, 2, 9, 4], [3, 1, 4], [12, 40, 7, 33, 8, 61, 2, 19, 5, 28, 50], [9, 2]]


def build_moe_contract(factory: Factory, path: str, tolerance: float = LOGPROB_TOLERANCE,
                       hf_config: dict | None = None) -> Contract:
    """``build_contract`` for ``routed_experts``: the tiny MoE checkpoint ``hf_config`` (default: ``qwen3_moe``'s),
    transformers on it and the engine; ``prompts`` are ``ROUTE_PROMPTS``, ``length_prompt`` the first of them whose
    greedy run has no eos within LONG_TOKENS (the request to abort), ``stop_prompt`` empty (the check needs none)."""
    from rlcore_testing.models import write_checkpoint

    hf_config = hf_config or moe_hf_config("qwen3_moe")
    reference = write_checkpoint(hf_config, path)
    eos = hf_config["eos_token_id"]
    write_word_tokenizer(path, hf_config["vocab_size"], eos)
    prompts = [list(p) for p in ROUTE_PROMPTS]
    long = next((p for p in prompts if eos not in greedy_continuation(reference, p, LONG_TOKENS, eos)[0]), None)
    if long is None:
        raise RuntimeError(f"every prompt of ROUTE_PROMPTS reaches eos greedily within {LONG_TOKENS} tokens on "
                           f"{hf_config['architectures'][0]}: add one that does not")
    return Contract(factory(path), reference, path, hf_config, eos, [], long, prompts, tolerance)


def moe_hf_config(name: str) -> dict:
    """The tiny MoE model ``name`` of ``MOE_MODELS`` (the family plugin's config; ``write_checkpoint`` makes its
    routers decisive, so that routing is not all ties)."""
    from rlcore.plugins import load_plugins

    plugin, family, sizes = MOE_MODELS[name]
    return load_plugins([plugin]).registry.get("models", family).tiny_hf_config(**{**_MOE_SIZES, **sizes})


def _routers(model) -> dict[int, torch.nn.Module]:
    """transformers' MoE routers by decoder layer index (from the module names)."""
    routers = {}
    for name, module in model.named_modules():
        if _ROUTER.search(type(module).__name__):
            layer = re.search(r"layers\.(\d+)\.", name)
            assert layer is not None, f"a router outside the decoder layers: {name}"
            routers[int(layer.group(1))] = module
    return dict(sorted(routers.items()))


def reference_routes(model, sequence: Sequence[int]) -> torch.Tensor:
    """transformers' top-k expert ids for ``sequence`` alone [len, MoE layers, top_k] int16, each row ascending."""
    fired: dict[int, torch.Tensor] = {}
    routers = _routers(model)
    handles = [router.register_forward_hook(lambda module, args, out, layer=layer: fired.__setitem__(layer, out[-1]))
               for layer, router in routers.items()]
    try:
        with torch.no_grad():
            model(torch.tensor([list(sequence)]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([fired[layer] for layer in routers], 1).sort(-1).values.to(ROUTES_DTYPE)


def _assert_routes(c: Contract, prompt: list[int], gen: Completion) -> None:
    routes, n = gen.routed_experts, len(prompt) + len(gen.tokens) - 1
    experts = next(c.hf_config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in c.hf_config)
    shape = (n, len(_routers(c.reference)), c.hf_config["num_experts_per_tok"])
    assert isinstance(routes, torch.Tensor), f"{gen.request_id}: no routed experts ({routes!r})"
    assert routes.dtype == ROUTES_DTYPE, f"{gen.request_id}: routed experts of dtype {routes.dtype}"
    assert tuple(routes.shape) == shape, \
        f"{gen.request_id}: routed experts of shape {tuple(routes.shape)}, expected {shape} (tokens fed: prompt " \
        f"{len(prompt)} + response {len(gen.tokens)} - 1, MoE layers, top_k)"
    routes = routes.cpu()
    assert ((routes >= 0) & (routes < experts)).all(), f"{gen.request_id}: expert ids outside [0, {experts})"
    assert (routes[..., 1:] > routes[..., :-1]).all(), f"{gen.request_id}: a row not ascending, or with a repeat"
    differ = (routes != reference_routes(c.reference, (prompt + gen.tokens)[:n])).any(-1)
    assert not differ.any(), f"{gen.request_id}: routes differ from transformers' at (token, MoE layer) " \
                             f"{differ.nonzero().tolist()[:8]} of {tuple(differ.shape)}"


def check_routed_experts(c: Contract) -> None:
    """Routing replay (actor.moe.routing_replay=rollout) makes the learner's MoE layers route each token as the
    engine did: each token fed needs its route, in layer order, from the forward that sampled the next token."""
    requests = list(zip(c.prompts, [MAX_TOKENS, 3, 1, 5]))      # of several lengths, each its own budget

    async def together():       # the long request is still running when the others are done
        aborted = asyncio.ensure_future(c.engine.generate(c.length_prompt, Sampling(LONG_TOKENS, 0.0), None,
                                                          "routes-aborted"))
        done = await asyncio.gather(*(c.engine.generate(prompt, Sampling(max_tokens, 0.0), None, f"routes-{i}")
                                      for i, (prompt, max_tokens) in enumerate(requests)))
        c.engine.abort("routes-aborted")
        return list(done), await aborted

    done, aborted = run(together())
    for (prompt, _), gen in zip(requests, done):
        _assert_routes(c, prompt, gen)
    assert aborted.finish_reason == "abort" and 0 < len(aborted.tokens) < LONG_TOKENS, aborted
    _assert_routes(c, c.length_prompt, aborted)
    c.engine.update_weights(checkpoint_weights(c), c.engine.version + 1)      # the model rebuilt or reloaded
    again = run(c.engine.generate(requests[0][0], Sampling(MAX_TOKENS, 0.0), None, "routes-after-push"))
    _assert_routes(c, requests[0][0], again)
    before, after = done[0].routed_experts, again.routed_experts     # both checked above
    assert again.tokens == done[0].tokens and before is not None and after is not None, again
    assert torch.equal(after.cpu(), before.cpu()), "the routes changed after pushing the same weights"
    print(f"routed experts of {len(done) + 2} requests ({len(_routers(c.reference))} MoE layers of "
          f"{c.hf_config['num_hidden_layers']}) equal transformers' routers")


ROUTED_EXPERTS_CHECKS: dict[str, Callable[[Contract], None]] = {"routed_experts": check_routed_experts}
