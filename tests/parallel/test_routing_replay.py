"""Routing replay (``actor.moe.routing_replay=rollout``) in the learner, on tiny Qwen3-MoE, Mixtral, DeepSeek-V3
and Qwen2-MoE models (DeepSeek's first layer dense, its second MoE: the layer mapping skips dense layers), at TP1,
TP2 with sequence parallelism, EP2, PP2 and CP2, with fixed-size, token-budget and packed micro-batches:

- with replay, every MoE layer routes every token to the batch's experts (asserted layer by layer, on every rank's
  share); routed live, the same tokens mostly go elsewhere (the routes are random, as a stale or mismatched engine's
  would differ);
- one update under replay moves the weights as in one process at every layout, and in one process the router's
  gradient equals transformers' forward and backward with its top-k replaced by the replayed experts (a plain-torch
  reference nobody here wrote; the gradient is read off the update: Adam with beta1 = 0 and a large eps moves a
  weight by lr * g / (|g| + eps), exactly invertible).
"""
import pathlib
import re
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_jobs_by_world

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

LR, EPS = 1000.0, 1000.0
RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, TESTS_DIR)      # replay_batch, from this file
    from rlcore.config.schema import ActorConfig, MoESection, OptimConfig, ParallelConfig
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.routed_experts import ROUTED_EXPERTS
    from rlcore_model_deepseek.plugin import DEEPSEEK_V3
    from rlcore_model_mixtral.plugin import MIXTRAL
    from rlcore_model_qwen2.plugin import QWEN2_MOE
    from rlcore_model_qwen3.plugin import QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS
    from test_routing_replay import replay_batch, LR, EPS

    FAMILIES = {spec.name: spec for spec in (QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, QWEN2_MOE)}

    def replay(path, family, tp, pp, ep, cp, sp, mbs, tokens, packed):
        hf = read_hf_config(path)
        cfg = ActorConfig(micro_batch_size=mbs, max_tokens_per_micro_batch=tokens, pack_sequences=bool(packed),
                          optim=OptimConfig(lr=LR, adam_beta1=0.0, adam_eps=EPS, clip_grad=0.0),
                          parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, cp=cp, sp=bool(sp)),
                          moe=MoESection(routing_replay="rollout"))
        actor = MegatronActor(FAMILIES[family], hf, cfg, SPECS[0], hf_state=read_hf_weights(path))
        batch = replay_batch(hf)
        dp, rank = actor.dp_size, actor.dp_rank
        share = batch.select(range(rank * len(batch) // dp, (rank + 1) * len(batch) // dp))
        _, live, _ = actor.routing(share)
        _, replayed, routed = actor.routing(share, replay=True, keep=True)
        expected = share[ROUTED_EXPERTS]
        has = (expected >= 0).all(-1)                         # [rows, S, layers]: the positions with a route
        for layer in range(expected.shape[2]):
            here = has[:, :, layer]
            assert torch.equal(routed[:, :, layer][here], expected[:, :, layer][here]), f"layer {layer} not replayed"
        assert int(replayed.sum()) == 0 and int(live.sum()) > 0, (int(replayed.sum()), int(live.sum()))
        tokens = float(batch["response_mask"].sum())
        actor.train_step(share, lambda lp, mb: (aggregate(-lp * mb["weight"], mb["response_mask"], "token-mean",
                                                          tokens, len(batch)), {}))
        return {**{n: t.contiguous().clone() for n, t in actor.hf_weights()}, "live_differing": live.float()}

    def off_policy(path, family):
        # the engine's routes and logprobs: what the weights routed before an update (an engine on these weights
        # routes as transformers does, and transformers as the actor: the hf backend's contract and the logprob
        # check); then one Adam update of the routers' weights (the others put back), as a stale batch meets
        # newer routers
        hf = read_hf_config(path)
        cfg = ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=1e-2), moe=MoESection(routing_replay="rollout"))
        actor = MegatronActor(FAMILIES[family], hf, cfg, SPECS[0], hf_state=read_hf_weights(path))
        batch = replay_batch(hf)
        before, _, engine = actor.routing(batch, keep=True)
        batch[ROUTED_EXPERTS] = engine
        tokens = float(batch["response_mask"].sum())
        others = {p: p.detach().clone() for n, p in actor.model.named_parameters() if ".router." not in n}
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp * mb["weight"], mb["response_mask"], "token-mean",
                                                          tokens, len(batch)), {}))
        with torch.no_grad():
            for p, kept in others.items():
                p.copy_(kept)
        live, live_differing, _ = actor.routing(batch)
        replayed, replayed_differing, _ = actor.routing(batch, replay=True)
        return {"before": before, "live": live, "replayed": replayed, "live_differing": live_differing.float(),
                "replayed_differing": replayed_differing.float(), "routed": (engine >= 0).all(-1).all(-1).float(),
                "mask": batch["response_mask"]}

    def another_models_routes(path, family):
        hf = read_hf_config(path)
        actor = MegatronActor(FAMILIES[family], hf, ActorConfig(moe=MoESection(routing_replay="rollout")), SPECS[0],
                              hf_state=read_hf_weights(path))
        batch = replay_batch(hf)
        batch[ROUTED_EXPERTS] = torch.cat([batch[ROUTED_EXPERTS]] * 2, 2)      # twice the MoE layers
        try:
            actor.routing(batch, replay=True)
        except ValueError as e:
            assert "the engine returned another model's routes" in str(e), e
            return {"refused": torch.ones(1)}
        return {"refused": torch.zeros(1)}
""").replace("TESTS_DIR", repr(str(pathlib.Path(__file__).parent))) + RUN_JOBS

FAMILY_SIZES = dict(vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    ffn_hidden_size=64, max_position_embeddings=64)
LAYOUTS = {   # name: (processes, tp, pp, ep, cp, sp, micro-batch size, token budget per micro-batch, packed)
    "tp1": (1, 1, 1, 1, 1, 0, 3, 0, 0),
    "tp2-sp": (2, 2, 1, 1, 1, 1, 8, 0, 0),
    "ep2": (2, 1, 1, 2, 1, 0, 2, 0, 0),
    "pp2": (2, 1, 2, 1, 1, 0, 2, 0, 0),
    "cp2": (2, 1, 1, 1, 2, 0, 4, 0, 0),
    "budget": (1, 1, 1, 1, 1, 0, 1, 24, 0),
    "packed": (1, 1, 1, 1, 1, 0, 1, 24, 1),
    "packed-tp2-sp": (2, 2, 1, 1, 1, 1, 1, 24, 1),
}
REFERENCE = (1, 1, 1, 1, 1, 0, 8, 0, 0)     # one process, the whole batch in one micro-batch
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe")    # top-k then softmax; sigmoid, groups and
                                                                    # a score bias; softmax then top-k


def replay_batch(hf: dict):
    """Eight sequences of 4 to 11 tokens with random routed experts (distinct, sorted) for every token but each
    sequence's last, per MoE layer; the same on every rank."""
    from rlcore.data import Batch, build_sequences
    from rlcore.routed_experts import MISSING, ROUTED_EXPERTS

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, hf["vocab_size"], (3 + i % 4,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(1, hf["vocab_size"], (1 + i % 5,), generator=g).tolist() for i in range(8)]
    batch = Batch(build_sequences(prompts, responses, pad_id=0))
    batch["weight"] = torch.rand(batch["input_ids"].shape, generator=g)
    experts = hf.get("num_local_experts") or hf.get("num_experts") or hf["n_routed_experts"]
    layers = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)
    rows, width = batch["input_ids"].shape
    routes = torch.rand(rows, width, layers, experts, generator=g).argsort(-1)[..., :hf["num_experts_per_tok"]]
    routes = routes.sort(-1).values.to(torch.int16)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        routes[i, len(p) + len(r) - 1:] = MISSING
    batch[ROUTED_EXPERTS] = routes
    return batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from rlcore_model_deepseek.plugin import DEEPSEEK_V3
    from rlcore_model_mixtral.plugin import MIXTRAL
    from rlcore_model_qwen2.plugin import QWEN2_MOE
    from rlcore_model_qwen3.plugin import QWEN3_MOE
    from rlcore_testing.models import tiny_checkpoint

    tmp = tmp_path_factory.mktemp("replay")
    paths = {}
    for spec in (QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, QWEN2_MOE):
        paths[spec.name] = str(tmp / spec.name)
        tiny_checkpoint(spec, paths[spec.name], **FAMILY_SIZES)
    jobs = {(family, layout): ((LAYOUTS.get(layout) or REFERENCE)[0],
                               {"run": "replay", "args": [paths[family], family,
                                                          *(LAYOUTS.get(layout) or REFERENCE)[1:]]})
            for family in FAMILIES for layout in ["reference", *LAYOUTS]}
    jobs.update({(family, "off-policy"): (1, {"run": "off_policy", "args": [paths[family], family]})
                 for family in FAMILIES})
    jobs["qwen3_moe", "wrong-shape"] = (1, {"run": "another_models_routes", "args": [paths["qwen3_moe"], "qwen3_moe"]})
    return run_jobs_by_world(RANK_SCRIPT, tmp, jobs), paths


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replayed_update_equals_one_process(runs, family, layout):
    """The rank script asserted the replay layer by layer; here the update under replay matches one process."""
    from rlcore.megatron.model import read_hf_weights

    results, paths = runs
    got, expected = results[family, layout], results[family, "reference"]
    start = read_hf_weights(paths[family])
    for name in start:
        moved = (expected[name] - start[name]).abs().max().item()
        assert (got[name] - expected[name]).abs().max().item() <= 1e-5 + 1e-4 * moved, name
    assert got["live_differing"].sum() > 0


def hf_router_gradients(path: str) -> dict[str, torch.Tensor]:
    """transformers' gradient of the same loss with each router's top-k replaced by the batch's routes: the router
    modules' ``torch.topk`` over all experts returns the replayed experts and their scores (gathered, so gradients
    flow as through a top-k); a position without a route takes experts 0..k-1, as the learner does."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from rlcore.megatron.model import read_hf_config
    from rlcore.routed_experts import ROUTED_EXPERTS

    hf = read_hf_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = replay_batch(hf)
    routes = batch[ROUTED_EXPERTS].long()
    routes = torch.where((routes < 0).any(-1, keepdim=True), torch.arange(routes.shape[-1]), routes)
    flat = routes.flatten(0, 1)                                  # [rows * S, layers, k]: HF's token order
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    assert len(routers) == routes.shape[2], (len(routers), routes.shape)
    layer = {"now": -1}
    real_topk = torch.topk

    def replayed_topk(scores, k, dim=-1, largest=True, sorted=True):
        if scores.dim() == 2 and scores.shape[-1] == experts_of[layer["now"]]:
            index = flat[:, layer["now"]]
            return torch.return_types.topk((scores.gather(1, index), index))
        return real_topk(scores, k, dim=dim, largest=largest, sorted=sorted)

    experts_of = {}
    for i, router in enumerate(routers):
        experts_of[i] = router.weight.shape[0]
        router.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__("now", i))
    ids = batch["input_ids"]
    with mock.patch("torch.topk", replayed_topk):
        logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"]
    loss = (-logp * batch["weight"] * mask).sum() / mask.sum()
    loss.backward()
    return {_layer(name): router.weight.grad for name, router in model.named_modules() if router in routers}


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_router_gradient_under_replay_equals_transformers_with_the_replayed_experts(runs, family):
    from rlcore.megatron.model import read_hf_weights

    results, paths = runs
    start, after = read_hf_weights(paths[family]), results[family, "reference"]
    reference = hf_router_gradients(paths[family])
    names = {_layer(n): n for n in start if re.search(r"layers\.\d+\.(mlp|block_sparse_moe)\.gate\.weight$", n)}
    assert reference and sorted(reference) == sorted(names), (sorted(reference), names)
    for layer, grad in reference.items():
        name = names[layer]            # the checkpoint's name (Mixtral's block_sparse_moe, transformers' mlp)
        step = after[name] - start[name]                              # -lr * g / (|g| + eps)
        got = -EPS * step / (LR - step.abs())
        assert grad.abs().max() > 1e-4, name
        assert torch.allclose(got, grad, rtol=1e-3, atol=1e-6), (name, (got - grad).abs().max().item(),
                                                                 grad.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_after_an_update_live_routing_drifts_from_the_engines_and_replay_removes_it(runs, family):
    """The off-policy case: after one update of the routers, the learner routed live sends a share of the tokens
    elsewhere in some layer; replayed, none; and the logprob gap to the engine's (what rollout_corr/* measure)
    shrinks with replay to what the routers' changed weights of the same experts leave."""
    got = runs[0][family, "off-policy"]
    routed, mask = got["routed"].bool(), got["mask"].bool()
    drifted = float((got["live_differing"][routed] > 0).float().mean())
    gap_live = float((got["live"] - got["before"]).abs()[mask].mean())
    gap_replayed = float((got["replayed"] - got["before"]).abs()[mask].mean())
    print(f"{family}: tokens routed elsewhere live {drifted:.3f}; |logp - engine's| live {gap_live:.6f}, "
          f"replayed {gap_replayed:.6f}")
    assert drifted > 0.02
    assert float(got["replayed_differing"].sum()) == 0
    assert gap_replayed < gap_live


def test_routes_of_another_shape_are_refused_naming_both(runs):
    assert runs[0]["qwen3_moe", "wrong-shape"]["refused"].item() == 1
