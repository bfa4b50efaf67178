"""actor.logprob_chunk_tokens: the output layer, log-probabilities and entropy run a chunk of tokens at a time. The
results equal those read off the model's own whole logits, training takes the same updates, and no tensor with the
vocabulary as its last dimension ever holds more than one chunk's tokens (forward or backward)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlcore.config.schema import ActorConfig, LoRASection
from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate
from rlcore.megatron.actor import MegatronActor
from rlcore.megatron.vocab_parallel import entropy, label_logprobs
from rlcore_testing.models import random_hf_state
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

VOCAB = 40      # no other dimension of the model is 40: a tensor ending in 40 is logits or derived from them
HF = QWEN3.tiny_hf_config(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                          ffn_hidden_size=64, max_position_embeddings=16)
BATCH = Batch(build_sequences([[1, 2, 3], [5, 6], [7, 8, 9, 10], [3]], [[4, 5, 6], [1], [2, 3], [9, 9, 9, 9]],
                              pad_id=0))
TEMPERATURE = 0.7


def build(chunk_tokens: int) -> MegatronActor:
    return MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, logprob_chunk_tokens=chunk_tokens,
                                                entropy_coef=0.01), SPECS[0], hf_state=random_hf_state(HF, 0.1))


class LargestVocabTensor(TorchDispatchMode):
    """The most rows (tokens) of any tensor whose last dimension is the vocabulary, created while active (but the
    output weight's transpose)."""
    rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB and t.dtype.is_floating_point \
                    and t.shape != (HF["hidden_size"], VOCAB):
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def whole_logits_stats(actor):
    """The reference: log p(label) and entropy read off the model's own logits, all tokens at once."""
    ids = BATCH["input_ids"]
    with torch.no_grad():
        logits = actor.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None) / TEMPERATURE
        return label_logprobs(logits.clone(), torch.roll(ids, -1, dims=1)), entropy(logits)


@pytest.mark.parametrize("chunk_tokens", [0, 3, 5, 1000])
def test_chunked_logprobs_and_entropy_equal_the_whole_logits(chunk_tokens):
    actor = build(chunk_tokens)
    ids = BATCH["input_ids"]
    want_logp, want_entropy = whole_logits_stats(actor)
    with torch.no_grad(), actor._reading_tokens(actor.model, TEMPERATURE):
        output = actor.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        logp, more = actor.token_outputs(output, torch.roll(ids, -1, dims=1), extras=True)
    one_chunk = chunk_tokens in (0, 1000)          # the batch's 32 tokens fit: the output layer's own logits
    assert output.shape[-1] == (VOCAB if one_chunk else HF["hidden_size"])
    # smaller chunks change the matmul's blocking (last bits only)
    tolerance = dict(rtol=0, atol=0) if one_chunk else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(logp, want_logp, **tolerance)
    torch.testing.assert_close(more["entropy"], want_entropy, **tolerance)
    torch.testing.assert_close(actor.logprobs(BATCH, temperature=TEMPERATURE), want_logp, **tolerance)


def update(actor):
    mask = BATCH["response_mask"]

    def loss(logp, mb, entropy):
        m = mb["response_mask"]
        value = aggregate(-logp - 0.01 * entropy, m, "token-mean", float(mask.sum()), len(BATCH))
        return value, {"loss": float(value)}
    return actor.train_step(BATCH, loss, temperature=TEMPERATURE, entropy=True)["loss"]


def test_chunked_training_takes_the_same_updates_holding_one_chunk_of_logits():
    whole, chunked = build(0), build(5)
    seen = {}
    for name, actor in (("whole", whole), ("chunked", chunked)):
        with LargestVocabTensor() as largest:
            losses = [update(actor) for _ in range(2)]
        seen[name] = (losses, largest.rows)
    torch.testing.assert_close(seen["chunked"][0], seen["whole"][0], rtol=0, atol=1e-6)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), chunked.model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    micro_batch_tokens = 2 * BATCH["input_ids"].shape[1]
    assert seen["whole"][1] >= micro_batch_tokens        # the check sees whole logits where they exist
    assert seen["chunked"][1] == 5


class WeightCopiesPerPosition(TorchDispatchMode):
    """Shapes of the tensors created while active that hold the output weight [vocab, hidden] once per position."""
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and tuple(t.shape[-2:]) == (VOCAB, HF["hidden_size"]):
                self.shapes.append(tuple(t.shape))
        return out


def test_a_frozen_output_layer_is_not_copied_per_position():
    """LoRA freezes the output layer. Its backward multiplies the logits' gradient, a transposed view, by the frozen
    weight, which torch.matmul did by broadcasting the weight to [positions, vocab, hidden] (Qwen2.5-0.5B: 8.1 GB
    for 32 positions, bench/lora_memory.py); the gradient is made contiguous first, so it is one matrix product."""
    actor = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, entropy_coef=0.01, lora=LoRASection(rank=4)),
                          SPECS[0], hf_state=random_hf_state(HF, 0.1))
    assert not actor.model.embedding.word_embeddings.weight.requires_grad
    with WeightCopiesPerPosition() as copies:
        update(actor)
    assert copies.shapes == []
