"""actor/critic.recompute: with selective (core attention) or full (every layer) activation recompute, the backward
pass really reruns those forwards, and the updates are the same, bit for bit, as keeping every activation."""
import pytest
import torch

from rlcore.config.schema import ActorConfig, CriticConfig
from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate
from rlcore.megatron.actor import MegatronActor
from rlcore.megatron.critic import MegatronCritic
from rlcore_testing.models import random_hf_state
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

HF = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                          ffn_hidden_size=64, max_position_embeddings=16)
BATCH = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5, 6]] * 4, pad_id=0))
BATCH["returns"] = torch.linspace(-1, 1, BATCH["input_ids"].numel()).view(BATCH["input_ids"].shape)
# where each mode reruns a forward in the backward pass
RERUN = {"selective": "self_attention.core_attention", "full": ""}


def build(role, recompute):
    if role == "actor":
        return MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, recompute=recompute), SPECS[0],
                             hf_state=random_hf_state(HF, 0.1))
    return MegatronCritic(QWEN3, HF, CriticConfig(micro_batch_size=2, recompute=recompute), SPECS[0],
                          hf_state=random_hf_state(HF, 0.1))


def update(model, role):
    mask = "response_mask"
    if role == "actor":
        return model.train_step(BATCH, lambda lp, mb: (aggregate(-lp, mb[mask], "token-mean", 12.0, 4),
                                                       {"loss": float(-(lp * mb[mask]).sum())}))["loss"]
    return model.train_step(BATCH, lambda v, mb: (aggregate((v - mb["returns"]).square(), mb[mask], "token-mean",
                                                            12.0, 4), {"loss": float(((v - mb["returns"]) ** 2).sum())}
                                                  ))["loss"]


def forwards_of(model, suffix):
    """Counts the forward calls of the first layer (or of its submodule named ``suffix``)."""
    layer = model.model.decoder.layers[0]
    module = layer.get_submodule(suffix) if suffix else layer
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_reruns_forwards_and_changes_no_update(role, mode):
    kept, recomputed = build(role, "none"), build(role, mode)
    assert recomputed.model.config.recompute_granularity == mode
    kept_calls, recomputed_calls = forwards_of(kept, RERUN[mode]), forwards_of(recomputed, RERUN[mode])
    for _ in range(2):
        assert update(recomputed, role) == update(kept, role)
    assert len(kept_calls) == 4 and len(recomputed_calls) == 8        # 2 updates x 2 micro-batches, then rerun
    for (name, a), (_, b) in zip(kept.model.named_parameters(), recomputed.model.named_parameters()):
        assert torch.equal(a, b), name
