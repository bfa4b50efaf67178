"""What the actor and the critic read off a Megatron model per token: the policy's entropy (exact, and trainable
without disturbing the logprobs), and the critic's value head (starts at zero, learns its targets)."""
import pytest
import torch

from rlcore.config.schema import ActorConfig, CriticConfig, OptimConfig
from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate, masked_mean
from rlcore_testing.models import random_hf_state
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

HF = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          ffn_hidden_size=64, max_position_embeddings=16)
BATCH = Batch(build_sequences([[1, 2, 3], [4, 5]], [[6, 7, 8], [9]], pad_id=0))   # a response of length 1


def full_logits(model, batch):
    ids = batch["input_ids"]
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).float()


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_entropy_equals_torch_and_leaves_logprobs_exact(entropy_coef):
    from rlcore.megatron.actor import MegatronActor

    actor = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, entropy_coef=entropy_coef), SPECS[0],
                          hf_state=random_hf_state(HF, 0.5))
    logits = full_logits(actor.model, BATCH)
    expected_h = torch.distributions.Categorical(logits=logits).entropy()
    expected_logp = torch.log_softmax(logits, -1).gather(-1, torch.roll(BATCH["input_ids"], -1, 1)[..., None])[..., 0]
    seen = {}

    def loss_fn(logp, mb, entropy):
        seen.update(logp=logp.detach().clone(), entropy=entropy.detach().clone())
        mask = mb["response_mask"]
        return aggregate(-logp - entropy_coef * entropy, mask, "token-mean", float(mask.sum()), 2), {}

    actor.train_step(BATCH, loss_fn, entropy=True)
    assert (seen["entropy"] - expected_h).abs().max() < 1e-5
    assert (seen["logp"] - expected_logp).abs().max() < 1e-5
    assert 0.5 < float(expected_h.mean()) < 2.7   # informative logits, not the uniform ln(16) = 2.77


def test_entropy_bonus_raises_entropy():
    """Descending on -entropy alone must make the policy less certain."""
    from rlcore.megatron.actor import MegatronActor

    actor = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, entropy_coef=1.0, optim=OptimConfig(lr=1e-2)),
                          SPECS[0], hf_state=random_hf_state(HF, 0.5))
    mask = BATCH["response_mask"]
    before = masked_mean(torch.distributions.Categorical(logits=full_logits(actor.model, BATCH)).entropy(), mask)
    for _ in range(5):
        actor.train_step(BATCH, lambda logp, mb, entropy: (
            aggregate(-entropy, mb["response_mask"], "token-mean", float(mask.sum()), 2), {}), entropy=True)
    after = masked_mean(torch.distributions.Categorical(logits=full_logits(actor.model, BATCH)).entropy(), mask)
    assert after > before + 0.05, (before, after)


def test_value_head_starts_at_zero_and_learns_its_targets():
    from rlcore.megatron.critic import MegatronCritic

    critic = MegatronCritic(QWEN3, HF, CriticConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-2)), SPECS[0],
                            hf_state=random_hf_state(HF, 0.5))
    head = dict(critic.model.named_parameters())["output_layer.weight"]
    assert head.shape == (1, HF["hidden_size"]), "the LM head is replaced by a scalar value head"
    mask = BATCH["response_mask"]
    values = critic.values(BATCH)
    assert values.shape == BATCH["input_ids"].shape and torch.equal(values, torch.zeros_like(values))
    targets = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    batch = Batch({**BATCH.tensors, "returns": targets})

    def loss_fn(v, mb):
        m = mb["response_mask"]
        return aggregate(0.5 * (v - mb["returns"]).square(), m, "token-mean", float(mask.sum()), 2), {}

    for _ in range(30):
        metrics = critic.train_step(batch, loss_fn)
    assert "critic/grad_norm" in metrics
    error = masked_mean((critic.values(BATCH) - targets).abs(), mask)
    assert error < 0.2, error
