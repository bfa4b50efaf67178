"""rlcore's save of the distributed optimizer's state (rlcore.megatron.optimizer_state, built without megatron-core's
gather) writes exactly what megatron-core's own ``fully_reshardable`` save writes: at DP2, where some parameters'
state is split between the two ranks' shards, for a dense model (one optimizer) and a MoE one at EP2 (a DP2 dense
optimizer and a DP1 expert one, chained), every tensor and every other entry megatron-core loads back from the two checkpoints is equal,
bit for bit."""
import textwrap

import pytest
from ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from safetensors.torch import save_file
    from rlcore.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import _sharded_state, save_model
    from rlcore.megatron.optimizer_state import _pieces
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS
    out, directory, family = sys.argv[1:4]
    spec = {"dense": QWEN3, "moe": QWEN3_MOE}[family]
    # three layers: two would put the DP2 shard boundary exactly between two parameters
    hf = spec.tiny_hf_config(vocab_size=48, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=16, ffn_hidden_size=96, max_position_embeddings=32)
    parallel = ParallelConfig(ep=2 if family == "moe" else 1)   # experts: an optimizer of their own, at expert DP1
    actor = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2), parallel=parallel),
                          SPECS[0])
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):   # moments that differ per element, and a step count
        batch = Batch(build_sequences([torch.randint(1, 48, (4,), generator=g).tolist() for _ in range(2)],
                                      [torch.randint(1, 48, (3,), generator=g).tolist() for _ in range(2)], pad_id=0))
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 6.0, 2), {}))
    chained = actor.optimizer.chained_optimizers
    split = sum(len(_pieces(b, s, e, i, o.data_parallel_group_gloo.size())) > 1
                for o in chained for b in o.buffers for s, e, i in b.param_index_map.values())

    save_model(actor, f"{directory}/rlcore")
    model = actor.model.sharded_state_dict(metadata={"dp_cp_group": mpu.get_data_parallel_group(
        with_context_parallel=True)})
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient":
                True}
    if dist.get_rank() == 0:
        os.makedirs(f"{directory}/megatron")
    dist.barrier()
    dist_checkpointing.save({"model": model, "optimizer": actor.optimizer.sharded_state_dict(model, metadata=metadata)},
                            f"{directory}/megatron", sharded_strategy=get_default_save_sharded_strategy("torch_dist"))

    def flat(tree, prefix=""):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
        if items is None:
            return {prefix: tree}
        return {k: v for key, sub in items for k, v in flat(sub, f"{prefix}/{key}").items()}

    ours, theirs = (flat(dist_checkpointing.load(_sharded_state(actor, True), f"{directory}/{name}"))
                    for name in ("rlcore", "megatron"))
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    tensors = 0
    for key, value in ours.items():
        if torch.is_tensor(value):
            tensors += 1
            assert value.dtype == theirs[key].dtype and value.shape == theirs[key].shape, key
            assert torch.equal(value.view(torch.uint8), theirs[key].view(torch.uint8)), key
        else:
            assert value == theirs[key], (key, value, theirs[key])
    if dist.get_rank() == 0:
        save_file({"tensors": torch.tensor(tensors), "split": torch.tensor(split),
                   "optimizers": torch.tensor(len(chained))}, out)
    del actor
    shutdown_parallel()
""")


@pytest.mark.parametrize("family, optimizers", [("dense", 1), ("moe", 2)])
def test_optimizer_state_equals_megatron_cores_own_save(tmp_path, family, optimizers):
    result = run_ranks(RANK_SCRIPT, tmp_path, 2, 29681, tmp_path / "result.safetensors", tmp_path, family)
    assert result["optimizers"].item() == optimizers
    assert result["split"].item() >= 1          # the path that sends a split parameter's state was taken
    assert result["tensors"].item() > 20
