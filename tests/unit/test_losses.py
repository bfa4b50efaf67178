"""Loss aggregation modes by hand, their invariance to how a mini-batch is split into micro-batches, and their
robustness: NaN/inf at masked-out positions and extreme log-ratios stay out of the loss and its gradient."""
import math

import pytest
import torch

from rlcore.losses import AGG_MODES, LOG_RATIO_BOUND, aggregate, clipped_surrogate, masked_mean, masked_whiten

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
])
def test_modes_by_hand(mode, expected):
    assert aggregate(PER_TOKEN, MASK, mode, MASK.sum().item(), 2).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_shares_sum_to_the_whole(mode):
    total = aggregate(PER_TOKEN, MASK, mode, MASK.sum().item(), 2)
    parts = sum(aggregate(PER_TOKEN[i:i + 1], MASK[i:i + 1], mode, MASK.sum().item(), 2) for i in range(2))
    assert parts.item() == pytest.approx(total.item())


def test_fully_masked_rows_contribute_nothing():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert aggregate(PER_TOKEN, mask, "seq-mean-token-mean", 3, 2).item() == pytest.approx(2.0 / 2)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(PER_TOKEN, MASK, "mean", 4, 2)


def test_token_sum_norm_by_hand():
    # each sequence's token sum over the constant 4 (the maximum response length), then the mean over 2 sequences
    expected = ((1 + 2 + 3) / 4 + 4 / 4) / 2
    assert aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", 4, 2, token_sum_norm=4).item() == \
        pytest.approx(expected)


def test_token_sum_norm_shares_sum_to_the_whole_whatever_the_padding():
    total = aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", 4, 2, token_sum_norm=8)
    # micro-batches padded to their own widths: the normaliser is the constant, not the width
    first = aggregate(PER_TOKEN[:1], MASK[:1], "seq-mean-token-sum-norm", 4, 2, token_sum_norm=8)
    second = aggregate(PER_TOKEN[1:, :1], MASK[1:, :1], "seq-mean-token-sum-norm", 4, 2, token_sum_norm=8)
    assert (first + second).item() == pytest.approx(total.item())


def test_token_sum_norm_needs_its_constant():
    with pytest.raises(ValueError, match="token_sum_norm"):
        aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", 4, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_nan_or_inf_at_a_masked_position_stays_out_of_the_loss_and_its_gradient(mode, bad):
    per_token = PER_TOKEN.clone()
    per_token[1, 2] = bad                                   # masked out in MASK
    per_token.requires_grad_(True)
    loss = aggregate(per_token, MASK, mode, 4, 2, token_sum_norm=4)
    clean = aggregate(PER_TOKEN, MASK, mode, 4, 2, token_sum_norm=4)
    assert torch.isfinite(loss) and loss.item() == clean.item()
    loss.backward()
    assert torch.isfinite(per_token.grad).all() and per_token.grad[1, 2] == 0


def test_masked_mean_and_whiten_ignore_nan_at_masked_positions():
    x = torch.tensor([1.0, 3.0, float("nan")])
    mask = torch.tensor([1.0, 1.0, 0.0])
    assert masked_mean(x, mask).item() == 2.0
    assert masked_whiten(x, mask).tolist() == pytest.approx([-1.0, 1.0, 0.0])


def test_where_selection_gives_the_same_bits_as_multiplying_for_finite_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 37, generator=gen) * 10
    mask = (torch.rand(16, 37, generator=gen) > 0.3).float()
    for mode in AGG_MODES:
        now = aggregate(x, mask, mode, float(mask.sum()), 16, token_sum_norm=37)
        before = x * mask                                   # the aggregation as it was, by multiplication
        ref = {"token-mean": lambda: before.sum() / float(mask.sum()),
               "seq-mean-token-mean": lambda: (before.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / 16,
               "seq-mean-token-sum": lambda: before.sum(-1).sum() / 16,
               "seq-mean-token-sum-norm": lambda: before.sum(-1).sum() / (37 * 16)}[mode]()
        assert torch.equal(now, ref), mode
    assert torch.equal(masked_mean(x, mask), (x * mask).sum() / mask.sum())
    mean = (x * mask).sum() / mask.sum()
    var = ((x - mean).square() * mask).sum() / mask.sum()
    assert torch.equal(masked_whiten(x, mask), (x - mean) * torch.rsqrt(var + 1e-8) * mask)


def test_an_extreme_log_ratio_gives_a_finite_loss_and_gradient():
    logp = torch.tensor([[0.0, 200.0, -200.0]], requires_grad=True)   # ratios e^0, e^200 (inf unclamped), e^-200
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    per_token, m = clipped_surrogate(logp, old, adv, mask, 0.2, 0.2)
    assert torch.isfinite(per_token).all() and per_token[0, 1].item() == pytest.approx(math.exp(LOG_RATIO_BOUND))
    aggregate(per_token, mask, "token-mean", 3, 1).backward()
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in m.values())


def test_clamp_leaves_ordinary_ratios_alone():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    per_token, _ = clipped_surrogate(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), 0.2, 0.3)
    assert torch.equal(per_token, torch.maximum(-torch.exp(logp), -torch.exp(logp).clamp(0.8, 1.3)))
