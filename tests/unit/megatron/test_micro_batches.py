"""actor.max_tokens_per_micro_batch: rows of similar length packed up to the budget, each micro-batch only as wide
as its longest row (or, with pack_sequences, its sequences end to end in one row), every row exactly once; the
per-token outputs equal the fixed-size micro-batches' outputs."""
import pytest
import torch

from rlcore.config.schema import ActorConfig
from rlcore.data import Batch, build_sequences
from rlcore.megatron.actor import MegatronActor
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

HF = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          ffn_hidden_size=64, max_position_embeddings=64)
LENGTHS = [(3, 30), (2, 2), (4, 25), (2, 3), (3, 1), (5, 20)]   # (prompt, response): long-tailed


def test_token_budget_micro_batches_are_narrow_and_give_the_same_outputs():
    g = torch.Generator().manual_seed(0)
    batch = Batch(build_sequences([torch.randint(1, 16, (p,), generator=g).tolist() for p, _ in LENGTHS],
                                  [torch.randint(1, 16, (r,), generator=g).tolist() for _, r in LENGTHS], pad_id=0))
    fixed = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2), SPECS[0], seed=3)
    budget = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, max_tokens_per_micro_batch=40), SPECS[0],
                           seed=3)
    micro, rows = budget._micro_batches(batch)
    assert sorted(i for r in rows for i in r) == list(range(len(LENGTHS)))
    totals = [p + r for p, r in LENGTHS]
    assert [m["input_ids"].shape[1] for m in micro] == [max(totals[i] for i in r) for r in rows]
    assert all(len(r) == 1 or len(r) * max(totals[i] for i in r) <= 40 for r in rows)
    assert sum(m["input_ids"].numel() for m in micro) < 0.6 * batch["input_ids"].numel()   # far less padding
    mask = batch["response_mask"]
    torch.testing.assert_close(budget.logprobs(batch) * mask, fixed.logprobs(batch) * mask, rtol=0, atol=1e-6)


def test_training_reports_the_padding_fraction_it_computed():
    batch = Batch(build_sequences([[1] * p for p, _ in LENGTHS], [[2] * r for _, r in LENGTHS], pad_id=0))
    tokens = sum(p + r for p, r in LENGTHS)                                   # 100 real positions
    loss = lambda lp, mb: ((lp * mb["response_mask"]).sum() * 0.0, {})      # noqa: E731
    for budget, computed in [(0, 6 * 33), (40, 33 + 29 + 25 + 3 * 5)]:
        # fixed: 3 micro-batches of 2 rows, 33 wide; budget 40, rows longest first: 33 | 29 | 25 | 5+4+4 (5 wide)
        actor = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2, max_tokens_per_micro_batch=budget),
                              SPECS[0], seed=3)
        assert actor.train_step(batch, loss)["actor/padding_frac"] == 1 - tokens / computed


def test_packed_sequences_give_the_same_outputs_and_update_without_padding():
    """pack_sequences: each micro-batch's sequences end to end in one row (attention within each, positions
    restarting): per-token outputs and a sequence-mean update equal the fixed-size path's."""
    from rlcore.losses import aggregate
    from rlcore.megatron.packing import pack

    g = torch.Generator().manual_seed(0)
    batch = Batch(build_sequences([torch.randint(1, 16, (p,), generator=g).tolist() for p, _ in LENGTHS],
                                  [torch.randint(1, 16, (r,), generator=g).tolist() for _, r in LENGTHS], pad_id=0))
    fixed = MegatronActor(QWEN3, HF, ActorConfig(micro_batch_size=2), SPECS[0], seed=3)
    packed = MegatronActor(QWEN3, HF, ActorConfig(max_tokens_per_micro_batch=40, pack_sequences=True), SPECS[0],
                           seed=3)
    micro, rows = packed._micro_batches(batch)
    totals = [p + r for p, r in LENGTHS]
    assert sorted(i for r in rows for i in r) == list(range(len(LENGTHS)))
    assert all(len(r) == 1 or sum(totals[i] for i in r) <= 40 for r in rows)
    assert [pack(m).ids.shape[1] for m in micro] == [sum(totals[i] for i in r) for r in rows]   # no padding
    mask = batch["response_mask"]
    torch.testing.assert_close(packed.logprobs(batch) * mask, fixed.logprobs(batch) * mask, rtol=0, atol=1e-6)
    loss = lambda lp, mb: (aggregate(-lp, mb["response_mask"], "seq-mean-token-mean", float(mask.sum()),  # noqa
                                     len(batch)), {})
    assert packed.train_step(batch, loss)["actor/padding_frac"] == 0.0
    fixed.train_step(batch, loss)
    for (name, a), (_, b) in zip(fixed.model.named_parameters(), packed.model.named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_packed_sequences_in_moe_and_latent_attention_families(family):
    """Routed experts (Mixtral) and multi-latent attention with its decoupled RoPE (DeepSeek-V3) read a packed row
    as they read the micro-batch."""
    from rlcore.plugins import load_plugins

    spec = load_plugins(["mixtral", "deepseek"]).registry.get("models", family)
    hf = spec.tiny_hf_config(vocab_size=16, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                             ffn_hidden_size=64, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    batch = Batch(build_sequences([torch.randint(1, 16, (p,), generator=g).tolist() for p, _ in LENGTHS],
                                  [torch.randint(1, 16, (r,), generator=g).tolist() for _, r in LENGTHS], pad_id=0))
    actor = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2), SPECS[0], seed=3)
    fixed = actor.logprobs(batch)
    actor.cfg.max_tokens_per_micro_batch, actor.cfg.pack_sequences = 40, True
    mask = batch["response_mask"]
    torch.testing.assert_close(actor.logprobs(batch) * mask, fixed * mask, rtol=0, atol=1e-6)
