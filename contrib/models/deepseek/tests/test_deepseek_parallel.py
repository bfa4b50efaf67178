"""DeepSeek-V3 over 2 processes (gloo), at EP2 and at TP2: loaded from and exported to HF exactly (expert bias
included) and logits equal to transformers'. EP2: the routed experts split over ranks (the dense first layer and the
shared experts replicated), and a training step keeps the replicated weights identical on both ranks and the expert
bias fixed. TP2: megatron's own shards of the MLA projections (column-parallel down projections included) are the
ones the weight rules cut."""
import textwrap

import pytest
from test_deepseek_conversion import checkpoint   # the tests' own folder is on sys.path (no __init__.py)
from runs import torchrun


pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM
    from rlcore.config.schema import ActorConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_deepseek.plugin import DEEPSEEK_V3
    from rlcore_plugins.optimizers import SPECS
    path, layout = sys.argv[1:]
    tp, ep = (2, 1) if layout == "tp2" else (1, 2)
    actor = MegatronActor(DEEPSEEK_V3, read_hf_config(path), ActorConfig(micro_batch_size=4,
                          parallel=ParallelConfig(tp=tp, ep=ep)), SPECS[0], hf_state=read_hf_weights(path))
    assert len(actor.model.decoder.layers[1].mlp.experts.local_experts) == 8 // ep
    on_disk = dict(read_hf_weights(path))
    exported = dict(actor.hf_weights())
    assert sorted(exported) == sorted(on_disk), set(exported) ^ set(on_disk)
    assert all(torch.equal(exported[n], t) for n, t in on_disk.items())
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = gather_from_tensor_model_parallel_region(actor.model.eval()(ids, positions, None))
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()
    if ep == 2:
        batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 4), {}))
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(dict(actor.hf_weights())[bias], on_disk[bias]), "the expert bias must stay fixed in RL"
        replicated = torch.tensor([float(sum(p.double().sum() for n, p in actor.model.named_parameters()
                                             if "local_experts" not in n))], dtype=torch.float64)
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(both, replicated)
        assert both[0].item() == both[1].item(), both
    rank = dist.get_rank()
    del actor
    shutdown_parallel()
    print(f"OK {layout} {rank}", flush=True)   # one write: two ranks share the pipe
""")


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_round_trip_and_logits_over_two_ranks(tmp_path, layout):
    checkpoint("deepseek_v3", str(tmp_path / "ckpt"))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = torchrun(2, script, tmp_path / "ckpt", layout)
    assert result.returncode == 0 and result.stdout.count(f"OK {layout}") == 2, result.stderr[-4000:]
