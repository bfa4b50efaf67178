"""rlcore.balance: data-parallel shares of nearly equal token counts, token-budget micro-batches, and the same
number of micro-batches on every rank; each sequence exactly once."""
import random

import pytest

from rlcore.balance import balanced_partition, split_to_count, token_budget_micro_batches


def long_tailed(n, seed):
    rng = random.Random(seed)
    return [min(1024, int(16 * rng.paretovariate(0.8))) for _ in range(n)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_balanced_partition_covers_every_sequence_once_with_nearly_equal_sums(parts):
    for seed in range(20):
        lengths = long_tailed(64, seed)
        groups = balanced_partition(lengths, parts)
        assert len(groups) == parts
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert max(sums) - min(sums) <= max(lengths)
        # no worse than dealing the sorted sequences out in turn
        dealt = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        dealt_sums = [sum(lengths[i] for i in dealt[r::parts]) for r in range(parts)]
        assert max(sums) - min(sums) <= max(dealt_sums) - min(dealt_sums)


def test_balanced_partition_by_hand():
    assert [len(g) for g in balanced_partition([1] * 8, 4)] == [2, 2, 2, 2]
    assert sorted(sum([10, 1, 1, 1, 1][i] for i in g) for g in balanced_partition([10, 1, 1, 1, 1], 2)) == [4, 10]
    assert balanced_partition([5], 3) == [[0], [], []]
    assert balanced_partition([], 2) == [[], []]
    with pytest.raises(ValueError):
        balanced_partition([1, 2], 0)


def test_token_budget_micro_batches_fit_the_budget_with_little_padding():
    lengths = long_tailed(256, 0)
    batches = token_budget_micro_batches(lengths, 2048)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 2048
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    fixed = sum(8 * max(lengths[i] for i in range(s, s + 8)) for s in range(0, 256, 8))   # 8 rows, input order
    assert padded < 0.5 * fixed
    assert token_budget_micro_batches([3, 9, 4, 2], 9) == [[1], [2, 0], [3]]   # by hand: 9 | 4+3 (2x4) | 2
    assert token_budget_micro_batches([20, 1], 8) == [[0], [1]]                 # over budget: alone


def test_packed_micro_batches_fill_the_budget_first_fit_longest_first():
    lengths = [3, 9, 4, 2, 6]
    # by hand, budget 10: 9 | 6 (then 4: 6+4) | 3 (then 2: 3+2)
    assert token_budget_micro_batches(lengths, 10, packed=True) == [[1], [4, 2], [0, 3]]
    assert token_budget_micro_batches([20, 1], 8, packed=True) == [[0], [1]]   # over budget: alone
    rng = random.Random(0)
    lengths = [rng.randint(16, 1024) for _ in range(64)]
    batches = token_budget_micro_batches(lengths, 2048, packed=True)
    assert sorted(i for b in batches for i in b) == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in batches)
    assert len(batches) < len(token_budget_micro_batches(lengths, 2048))    # no padding: fewer micro-batches


def test_split_to_count_gives_every_rank_the_same_number():
    lengths = [8, 8, 8, 8, 2, 2]
    batches = token_budget_micro_batches(lengths, 32)        # [[0, 1, 2, 3], [4, 5]]
    assert batches == [[0, 1, 2, 3], [4, 5]]
    assert split_to_count(batches, lengths, 3) == [[4, 5], [0, 1], [2, 3]]   # the widest halved
    four = split_to_count(batches, lengths, 4)
    assert len(four) == 4 and sorted(i for b in four for i in b) == list(range(6))
    assert split_to_count([[0]], [5], 3) == [[0], [], []]     # nothing left to split: empty micro-batches
    with pytest.raises(ValueError):
        split_to_count(batches, lengths, 1)


def test_no_share_is_left_empty_when_there_are_enough_sequences():
    for seed in range(500):
        rng = random.Random(seed)
        parts = rng.randint(1, 8)
        lengths = [rng.choice([1, 2, 1000, rng.randint(1, 2000)]) for _ in range(rng.randint(parts, 3 * parts))]
        assert all(balanced_partition(lengths, parts)), (lengths, parts)


def test_data_parallel_shares_balance_tokens_and_results_come_back_in_batch_order():
    import torch

    from rlcore.data import Batch, build_sequences
    from rlcore.workers.group import dp_parts, in_batch_order

    lengths = [(2, 40), (2, 38), (2, 1), (2, 2), (2, 3), (2, 1)]     # contiguous halves: 85 and 12 tokens
    batch = Batch(build_sequences([[1] * p for p, _ in lengths], [[2] * r for _, r in lengths], pad_id=0))
    parts = dp_parts(batch, 2)
    assert sorted(sum(p + r for p, r in (lengths[i] for i in part)) for part in parts) == [48, 49]
    results = [batch["input_ids"][part] * 10 for part in parts]         # what each rank computes for its rows
    assert torch.equal(in_batch_order(parts, results), batch["input_ids"] * 10)
    plain = Batch({"input_ids": batch["input_ids"]})                    # rows without lengths: contiguous
    assert dp_parts(plain, 4) == [[0, 1], [2, 3], [4], [5]]
