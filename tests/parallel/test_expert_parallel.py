"""EP2 on a Qwen3-MoE model (2 processes, gloo): experts split over ranks, and a training step keeps the shared
(non-expert) weights identical on both ranks. Loading and exporting at EP2 and the logits are rlcore's conformance
check (rlcore_testing.models.assert_expert_parallel, run by the model plugins' tests); the engine side (vLLM logprobs
equal the actor's after every sync, rollout TP 1 and 2) is the ``moe-ep2`` layouts in test_layouts.py."""
import textwrap

import pytest
from runs import torchrun


pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from rlcore.config.schema import ActorConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS
    path = sys.argv[1]
    actor = MegatronActor(QWEN3_MOE, read_hf_config(path), ActorConfig(micro_batch_size=4,
                          parallel=ParallelConfig(ep=2)), SPECS[0], hf_state=read_hf_weights(path))
    rank = dist.get_rank()
    local_experts = len(actor.model.decoder.layers[0].mlp.experts.local_experts)
    assert local_experts == 2, local_experts             # 4 experts over 2 ranks
    batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))
    actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 4), {}))
    dense = torch.tensor([float(sum(p.double().sum() for n, p in actor.model.named_parameters()
                                    if "local_experts" not in n))])
    both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, dense.double())
    assert both[0].item() == both[1].item(), both
    del actor
    shutdown_parallel()
    print(f"EP2 OK {rank}", flush=True)
""")


def test_ep2_training_step_keeps_shared_weights_identical(tmp_path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlcore_model_qwen3.plugin import QWEN3_MOE

    torch.manual_seed(0)
    hf = QWEN3_MOE.tiny_hf_config(vocab_size=48, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=32, ffn_hidden_size=96, max_position_embeddings=32)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name and "experts" not in name:
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "ckpt")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = torchrun(2, script, tmp_path / "ckpt")
    assert result.returncode == 0 and result.stdout.count("EP2 OK") == 2, result.stderr[-4000:]
