"""Loss aggregation modes by hand, and their invariance to how a mini-batch is split into micro-batches."""
import pytest
import torch

from rlcore.losses import aggregate

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
