"""The learning-rate schedule: warm-up then constant / cosine / linear, applied to Megatron's optimizer and logged."""
import math

import pytest
import torch

from rlcore.config.schema import ActorConfig, OptimConfig
from rlcore.lr_schedule import learning_rate, total_updates


def test_warmup_rises_linearly_then_constant():
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=4)
    assert [learning_rate(u, optim, 10) for u in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("schedule, middle", [("cosine", 0.5 * (1 + math.cos(math.pi * 0.5))), ("linear", 0.5)])
def test_decay_reaches_min_lr_at_the_last_update(schedule, middle):
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule=schedule, min_lr=1e-4)
    lrs = [learning_rate(u, optim, 13) for u in range(13)]
    assert lrs[1] == pytest.approx(1e-3) and lrs[2] == pytest.approx(1e-3)      # the first update after warm-up
    assert lrs[7] == pytest.approx(1e-4 + 9e-4 * middle)                        # half-way: updates 2 .. 12
    assert lrs[-1] == pytest.approx(1e-4) and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_total_updates_counts_mini_batches_and_epochs():
    assert total_updates(10, ActorConfig(mini_batches=2, epochs=3)) == 60


def test_the_actor_applies_and_logs_the_schedule(tmp_path):
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS

    tiny_checkpoint(QWEN3, str(tmp_path), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_hidden_size=64, max_position_embeddings=32)
    cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule="linear"))
    actor = MegatronActor(QWEN3, read_hf_config(str(tmp_path)), cfg, SPECS[0],
                          hf_state=read_hf_weights(str(tmp_path)), total_updates=4)
    batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))
    loss = lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 4), {})  # noqa: E731
    weights = lambda: [p.detach().clone() for p in actor.model.parameters()]  # noqa: E731
    logged, moved = [], []
    for _ in range(4):
        before = weights()
        logged.append(actor.train_step(batch, loss)["actor/lr"])
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, weights())))
    assert logged == pytest.approx([5e-4, 1e-3, 1e-3, 0.0])
    assert moved == [True, True, True, False]          # the optimizer steps with the scheduled LR (0 at the end)
