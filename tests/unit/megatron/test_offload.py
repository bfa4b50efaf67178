"""Actor offload/onload of params, grads and optimizer state (a bf16 model's fp32 main params included): the device
storage is really freed, and training after a round trip is bit-identical to training without one."""
import pytest
import torch

from rlcore.config.schema import ActorConfig
from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate
from rlcore.megatron.actor import MegatronActor
from rlcore_testing.models import random_hf_state
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

HF = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          ffn_hidden_size=64, max_position_embeddings=16)
BATCH = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))


def loss(lp, mb):
    return aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 4), {"loss": float(-(lp * mb["response_mask"]).sum())}


def fresh_actor(dtype):
    return MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=4, dtype=dtype), SPECS[0],
                         hf_state=random_hf_state(HF, 0.1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_round_trip_frees_storage_and_changes_nothing(dtype):
    plain, offloaded = fresh_actor(dtype), fresh_actor(dtype)
    for step in range(3):
        expected = plain.train_step(BATCH, loss)["loss"]
        if step > 0:   # optimizer state exists after the first step
            for what in ("optimizer", "grads", "params"):
                assert offloaded.offload(what) > 0
                assert all(t.untyped_storage().nbytes() == 0 for t in offloaded._memory(what)), what
            for what in ("params", "grads", "optimizer"):
                offloaded.onload(what)
        assert offloaded.train_step(BATCH, loss)["loss"] == expected
    for (n, a), (_, b) in zip(plain.model.named_parameters(), offloaded.model.named_parameters()):
        assert torch.equal(a, b), n

