"""rlcore's save of the distributed optimizer's state (rlcore.megatron.optimizer_state, built without megatron-core's
gather, and without a second copy of fp32 weights) round-trips exactly as megatron-core's own ``fully_reshardable``
save does: at DP2, where some parameters' state is split between the two ranks' shards, for a dense model (one
optimizer; fp32, and bf16 with separate fp32 main copies) and a MoE one at EP2 (a DP2 dense optimizer and a DP1
expert one, chained), the weights, main copies, Adam moments and step loaded back from either checkpoint equal the
saved ones, bit for bit."""
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_rank_jobs, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from rlcore.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model, save_model
    from rlcore.megatron.optimizer_state import _pieces
    from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS

    def round_trip(directory, family):   # both checkpoints into directory; what was compared, counted
        spec = QWEN3_MOE if family == "moe" else QWEN3
        # three layers: two would put the DP2 shard boundary exactly between two parameters
        hf = spec.tiny_hf_config(vocab_size=48, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                                 head_dim=16, ffn_hidden_size=96, max_position_embeddings=32)
        parallel = ParallelConfig(ep=2 if family == "moe" else 1)   # experts: an optimizer of their own, expert DP1
        actor = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2), parallel=parallel,
                                                    dtype="bfloat16" if family == "dense-bf16" else "float32"),
                              SPECS[0])
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):   # moments that differ per element, and a step count
            batch = Batch(build_sequences([torch.randint(1, 48, (4,), generator=g).tolist() for _ in range(2)],
                                          [torch.randint(1, 48, (3,), generator=g).tolist() for _ in range(2)],
                                          pad_id=0))
            actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 6.0, 2), {}))
        chained = actor.optimizer.chained_optimizers
        split = sum(len(_pieces(b, s, e, i, o.data_parallel_group_gloo.size())) > 1
                    for o in chained for b in o.buffers for s, e, i in b.param_index_map.values())

        def state():     # every tensor a resume depends on, as bytes: weights, main copies, moments, steps
            tensors = {f"model/{n}": p for n, p in actor.model.named_parameters()}
            for i, o in enumerate(chained):
                for g_i, group in enumerate(o.optimizer.param_groups):
                    for p_i, main in enumerate(group["params"]):
                        tensors[f"{i}/{g_i}/{p_i}/main"] = main
                        for k, v in o.optimizer.state[main].items():
                            tensors[f"{i}/{g_i}/{p_i}/{k}"] = v
            return {k: v.detach().clone().view(-1).view(torch.uint8) for k, v in tensors.items()}

        def scramble():
            with torch.no_grad():
                for t in list(actor.model.parameters()) + [v for o in chained for s in o.optimizer.state.values()
                                                           for v in s.values() if torch.is_tensor(v)]:
                    t.add_(1)

        saved = state()
        save_model(actor, f"{directory}/rlcore")
        model = actor.model.sharded_state_dict(metadata={"dp_cp_group": mpu.get_data_parallel_group(
            with_context_parallel=True)})
        fp32 = {sh.key for sh in model.values() if getattr(sh, "data", None) is not None   # before the save expands
                and sh.data.dtype == torch.float32}                                          # its factories in place
        metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True}
        if dist.get_rank() == 0:
            os.makedirs(f"{directory}/megatron")
        dist.barrier()
        dist_checkpointing.save({"model": model,
                                 "optimizer": actor.optimizer.sharded_state_dict(model, metadata=metadata)},
                                f"{directory}/megatron",
                                sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
        main_copies = {name: {k.split("optimizer.state.param.", 1)[1]
                              for k in dist_checkpointing.load_tensors_metadata(f"{directory}/{name}")
                              if "optimizer.state.param." in k} for name in ("rlcore", "megatron")}
        # left out: exactly the parameters that train in fp32 (all of them in an fp32 model), their own main copies
        fp32 &= main_copies["megatron"]
        assert main_copies["rlcore"] == main_copies["megatron"] - fp32, (family, main_copies, fp32)
        for name in ("rlcore", "megatron"):      # megatron-core's own checkpoint has every main copy: rlcore's loader
            scramble()                           # reads it as megatron-core's does
            load_model(actor, f"{directory}/{name}")
            loaded = state()
            assert loaded.keys() == saved.keys(), family
            for key in saved:
                assert torch.equal(loaded[key], saved[key]), (family, name, key)
        return {"compared": torch.tensor(len(saved)), "split": torch.tensor(split),
                "optimizers": torch.tensor(len(chained)), "main_copies": torch.tensor(len(main_copies["rlcore"])),
                "megatron_main_copies": torch.tensor(len(main_copies["megatron"]))}
""") + RUN_JOBS


FAMILIES = {"dense": 1, "dense-bf16": 1, "moe": 2}   # family: optimizers (chained)


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """family -> what its round trip compared and counted; every family in one torchrun (ranks.RUN_JOBS: Megatron's
    groups rebuilt between them, the next at its own expert parallelism)."""
    tmp = tmp_path_factory.mktemp("optimizer_state")
    jobs = [{"run": "round_trip", "args": [str(tmp / family), family]} for family in FAMILIES]
    return dict(zip(FAMILIES, run_rank_jobs(RANK_SCRIPT, tmp, 2, jobs)))


@pytest.mark.parametrize("family, optimizers", FAMILIES.items())
def test_optimizer_state_round_trips_as_megatron_cores_own_save(round_trips, family, optimizers):
    result = round_trips[family]
    assert result["optimizers"].item() == optimizers
    assert result["split"].item() >= 1          # the path that sends a split parameter's state was taken
    assert result["compared"].item() > 60
    assert result["megatron_main_copies"].item() > 0
    # fp32 weights are their own main copies, not stored twice; bf16 ones have fp32 copies, stored
    assert (result["main_copies"].item() > 0) == (family == "dense-bf16")


ONE_OPTIMIZER_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    import rlcore.megatron.model as megatron_model
    from rlcore.config.schema import ActorConfig, OptimConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model, save_model
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS
    out, directory = sys.argv[1:3]
    hf = QWEN3_MOE.tiny_hf_config(vocab_size=48, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=16, ffn_hidden_size=96, max_position_embeddings=32)
    cfg = ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    batch = Batch(build_sequences([torch.randint(1, 48, (4,), generator=g).tolist() for _ in range(2)],
                                  [torch.randint(1, 48, (3,), generator=g).tolist() for _ in range(2)], pad_id=0))

    def update(actor):
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 6.0, 2), {}))

    mark = megatron_model.mark_expert_parameters
    megatron_model.mark_expert_parameters = lambda model: None     # the experts left dense: one optimizer
    old = MegatronActor(QWEN3_MOE, hf, cfg, SPECS[0])
    assert not hasattr(old.optimizer, "chained_optimizers") or len(old.optimizer.chained_optimizers) == 1
    for _ in range(2):
        update(old)
    save_model(old, directory)
    update(old)
    expected = {n: p.detach().clone() for n, p in old.model.named_parameters()}
    del old
    shutdown_parallel()
    megatron_model.mark_expert_parameters = mark
    new = MegatronActor(QWEN3_MOE, hf, cfg, SPECS[0], seed=1)
    assert len(new.optimizer.chained_optimizers) == 2
    load_model(new, directory)
    update(new)
    save_file({f"expected/{n}": t for n, t in expected.items()}
              | {f"got/{n}": p.detach().clone() for n, p in new.model.named_parameters()}, out)
    shutdown_parallel()
""")


def test_moe_checkpoint_of_one_optimizer_resumes_into_the_chained_one(tmp_path):
    """A MoE checkpoint saved when the experts shared the dense optimizer (EP1 before their allreduce=False flag)
    resumes: the update after the load equals the one the saving process made next, bit for bit."""
    result = run_ranks(ONE_OPTIMIZER_SCRIPT, tmp_path, 1, tmp_path / "result.safetensors", tmp_path / "ckpt")
    names = [n[len("expected/"):] for n in result if n.startswith("expected/")]
    assert any("experts" in n for n in names)
    for name in names:
        assert torch.equal(result[f"got/{name}"], result[f"expected/{name}"]), name
