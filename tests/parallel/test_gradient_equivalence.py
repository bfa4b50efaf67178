"""One optimizer step on the same batch gives the same weights in every layout as in one process: the loss shares,
micro-batching (fixed-size, token-budget micro-batches of rows of similar length cut to their longest row, or their
sequences packed end to end in one row), data-parallel averaging and context-parallel split add up to exactly the
global loss's gradient. The actor's loss includes an entropy bonus (vocab-parallel under TP; at TP2 its logits are
taken 7 tokens at a time, so the output layer's chunks and their recompute in the backward pass are checked too);
the critic's value head is checked the same way, through its values after one step.

Adam's usual first step is lr * sign(g): blind to a mis-scaled loss. With beta1 = 0 and eps far above |g| its
update is lr * g / (|g| + eps), i.e. nearly linear in g, so a wrong factor anywhere shows. (Megatron's distributed
optimizer supports only Adam.)"""
import textwrap

import pytest
from ranks import RUN_JOBS, run_rank_jobs

from rlcore.megatron.model import read_hf_weights

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

# Every job of one world size runs in one torchrun, one after another: starting the processes and importing
# Megatron (~15 s) cost 25 times what one step does. Between jobs only Megatron's groups are torn down and rebuilt
# at the next layout (init_parallel seeds on every call, so a model built later equals one built in a fresh process).
RANK_SCRIPT = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from rlcore.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.critic import MegatronCritic
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS

    def one_step(path, role, tp, pp, cp, mbs, sp, tokens, chunk, packed):
        hf = read_hf_config(path)
        spec = QWEN3_MOE if hf["model_type"] == "qwen3_moe" else QWEN3
        sgd_like = OptimConfig(lr=1000.0, adam_beta1=0.0, adam_eps=1000.0, clip_grad=0.0)
        cfg = ActorConfig(micro_batch_size=mbs, optim=sgd_like, parallel=ParallelConfig(tp=tp, pp=pp, cp=cp,
                                                                                      sp=bool(sp)),
                          entropy_coef=0.1, max_tokens_per_micro_batch=tokens, logprob_chunk_tokens=chunk,
                          pack_sequences=bool(packed))
        model = (MegatronActor if role == "actor" else MegatronCritic)(spec, hf, cfg, SPECS[0],
                                                                      hf_state=read_hf_weights(path))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 16, (3 + i % 3,), generator=g).tolist() for i in range(8)]
        responses = [torch.randint(1, 16, (2 + i % 4,), generator=g).tolist() for i in range(8)]
        batch = Batch(build_sequences(prompts, responses, pad_id=0))
        batch["weight"] = torch.rand(batch["input_ids"].shape, generator=g)   # makes every token's gradient differ
        batch["returns"] = torch.randn(batch["input_ids"].shape, generator=g)
        dp, rank = model.dp_size, model.dp_rank
        share = batch.select(range(rank * len(batch) // dp, (rank + 1) * len(batch) // dp))
        tokens = float(batch["response_mask"].sum())
        if role == "actor":
            model.train_step(share, lambda lp, mb, entropy: (
                aggregate((-lp - 0.1 * entropy) * mb["weight"], mb["response_mask"], "token-mean", tokens,
                          len(batch)), {}), entropy=True)
            return {n: t.contiguous().clone() for n, t in model.hf_weights()}
        for _ in range(2):   # the value head starts at 0: a first step moves only it, a second reaches the trunk
            model.train_step(share, lambda v, mb: (aggregate((v - mb["returns"]).square() * mb["weight"],
                                                             mb["response_mask"], "token-mean", tokens, len(batch)),
                                                   {}))
        return {"values": model.values(batch) * batch["response_mask"]}
""") + RUN_JOBS

LAYOUTS = {   # name: (processes, tp, pp, cp, micro-batch size, sequence parallel, token budget per micro-batch,
             #        actor's logprob_chunk_tokens, sequences packed into one row)
    "one-process-microbatched": (1, 1, 1, 1, 3, 0, 0, 0, 0),
    "dp2": (2, 1, 1, 1, 4, 0, 0, 0, 0),
    "tp2": (2, 2, 1, 1, 8, 0, 0, 7, 0),
    "tp2-sp": (2, 2, 1, 1, 8, 1, 0, 7, 0),
    "pp2": (2, 1, 2, 1, 2, 0, 0, 0, 0),
    "cp2": (2, 1, 1, 2, 8, 0, 0, 0, 0),
    # sequences of 5 to 10 tokens, 20 tokens per micro-batch: 2 to 4 rows each, as wide as their longest row; the
    # two DP2 shares pack into different numbers of micro-batches until evened out
    "budget": (1, 1, 1, 1, 1, 0, 20, 0, 0),
    "budget-dp2": (2, 1, 1, 1, 1, 0, 20, 0, 0),
    "budget-tp2": (2, 2, 1, 1, 1, 0, 20, 0, 0),
    "budget-pp2": (2, 1, 2, 1, 1, 0, 20, 0, 0),
    # the same budget in tokens without padding: 2 to 4 sequences end to end in each micro-batch's single row
    "packed": (1, 1, 1, 1, 1, 0, 20, 0, 1),
    "packed-tp2-sp": (2, 2, 1, 1, 1, 1, 20, 0, 1),
    "packed-pp2": (2, 1, 2, 1, 1, 0, 20, 0, 1),
}
BUDGETS = [name for name, layout in LAYOUTS.items() if layout[6]]


MOE = "moe"   # the MoE checkpoint's jobs are keyed by it; the dense ones by "dense"
CRITIC_LAYOUTS = ["dp2", "tp2-sp", "pp2", "cp2", *BUDGETS]
REFERENCE = (1, 1, 1, 1, 8, 0, 0, 0, 0)   # one process, the whole batch in one micro-batch


def tiny_moe(directory):
    """A tiny Qwen3-MoE checkpoint (4 experts, 2 a token; routers spread so that tokens pick different experts)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlcore_model_qwen3.plugin import QWEN3_MOE

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE.tiny_hf_config(
        vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=64,
        max_position_embeddings=32))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory / "ckpt")
    return directory / "ckpt"


@pytest.fixture(scope="module")
def steps(tmp_path_factory, tiny_qwen3):
    """Every step this file checks, by (checkpoint, role, layout): the one-process references and each layout's,
    run in one torchrun per world size. Returns it and the checkpoints (to measure how far a step moved weights)."""
    tmp = tmp_path_factory.mktemp("grad")
    checkpoints = {"dense": tiny_qwen3, MOE: tiny_moe(tmp)}
    wanted = [("dense", "actor", "reference"), ("dense", "critic", "reference"), (MOE, "actor", "reference"),
              *(("dense", "actor", layout) for layout in LAYOUTS), (MOE, "actor", "tp2-sp"),
              *(("dense", "critic", layout) for layout in CRITIC_LAYOUTS)]
    results = {}
    for procs in (1, 2):
        keys = [key for key in wanted if (LAYOUTS.get(key[2]) or REFERENCE)[0] == procs]
        jobs = [{"run": "one_step", "args": [str(checkpoints[model]), role, *(LAYOUTS.get(layout) or REFERENCE)[1:]]}
                for model, role, layout in keys]
        directory = tmp / f"world{procs}"
        directory.mkdir()
        results.update(zip(keys, run_rank_jobs(RANK_SCRIPT, directory, procs, jobs)))
    return results, checkpoints


def assert_same_step(got: dict, expected: dict, checkpoint) -> None:
    """Every weight after the step equals the one-process step's, within a part of how far that step moved it."""
    start = read_hf_weights(str(checkpoint))
    assert sorted(got) == sorted(expected)
    for name in expected:
        moved = (expected[name] - start[name]).abs().max().item()
        assert (got[name] - expected[name]).abs().max().item() <= 1e-5 + 1e-4 * moved, name
    assert max((expected[n] - start[n]).abs().max().item() for n in expected) > 1e-3, "the step changed weights"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_step_equals_one_process(steps, layout):
    results, checkpoints = steps
    assert_same_step(results["dense", "actor", layout], results["dense", "actor", "reference"], checkpoints["dense"])


# TP2 with sequence parallelism at EP1 (expert TP 1): each TP rank runs the experts on its own part of the tokens, so
# the experts' gradients are summed over the TP ranks (as expert data parallelism), not only over DP
def test_moe_one_step_equals_one_process(steps):
    results, checkpoints = steps
    assert_same_step(results[MOE, "actor", "tp2-sp"], results[MOE, "actor", "reference"], checkpoints[MOE])


@pytest.mark.parametrize("layout", CRITIC_LAYOUTS)
def test_critic_values_after_training_equal_one_process(steps, layout):
    results, _ = steps
    expected = results["dense", "critic", "reference"]["values"]
    got = results["dense", "critic", layout]["values"]
    assert expected.abs().max() > 0.1, "training moved the values off their zero start"
    assert (got - expected).abs().max() <= 1e-4 * (1 + expected.abs().max()), layout
