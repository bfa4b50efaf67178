"""Dynamic sampling (GRPO's algorithm.dynamic_sampling): groups whose rewards are all equal are dropped, more prompts
are sampled in their place, and every dropped group is counted."""
import pytest
import torch

from rlcore.controller import Samples, Timer
from rlcore.rewards import Scores


def samples(group_sizes, rewards):
    group_ids = torch.tensor([g for g, n in enumerate(group_sizes) for _ in range(n)])
    n = len(group_ids)
    total = torch.tensor(rewards, dtype=torch.float64)
    return Samples([[1]] * n, [[i] for i in range(n)], [[0.0]] * n, ["stop"] * n, [{"i": i} for i in range(n)],
                   group_ids, Scores(total, {"r": total}), total.float())


def test_select_and_concatenate_groups_renumber_them():
    a = samples([2, 2, 1], [1, 0, 1, 1, 0])
    b = samples([2], [0, 1])
    kept = Samples.cat([a.select_groups([0, 2]), b])
    assert kept.group_ids.tolist() == [0, 0, 1, 2, 2]
    assert [r[0] for r in kept.responses] == [0, 1, 4, 0, 1]
    assert kept.rewards.tolist() == [1, 0, 0, 0, 1] and kept.scores.components["r"].tolist() == [1, 0, 0, 0, 1]
    assert kept.first_groups(2).group_ids.tolist() == [0, 0, 1]
    assert len(a.select_groups([])) == 0 and a.select_groups([]).groups == 0


@pytest.mark.slow
def test_dynamic_sampling_keeps_only_groups_with_a_signal(quickstart):
    cfg = quickstart.cfg
    quickstart.algo_cfg.dynamic_sampling = True
    n = cfg.rollout.n
    cfg.rollout.n = 2          # pairs: often both right or both wrong, so some groups are dropped
    try:
        quickstart.workers.rollout_mode()
        metrics = {}
        kept, sampled = quickstart.sample(1, Timer(), metrics)
    finally:
        quickstart.algo_cfg.dynamic_sampling = False
        cfg.rollout.n = n
    for g in range(kept.groups):
        r = kept.rewards[kept.group_ids == g]
        assert len(r) == 2 and (r != r[0]).any(), "a kept group has differing rewards"
    rounds, dropped = metrics["sampling/rounds"], metrics["sampling/groups_dropped"]
    # sampling stops as soon as the batch is full, or after the last allowed round
    assert kept.groups == cfg.trainer.prompts_per_step or rounds == cfg.rollout.max_sampling_rounds
    # everything sampled is accounted for: kept groups + dropped groups + groups beyond the batch's size
    assert len(sampled.total) == rounds * cfg.trainer.prompts_per_step * 2
    assert dropped >= 1, "pairs of samples are often both right or both wrong"
    assert kept.groups == min(cfg.trainer.prompts_per_step, rounds * cfg.trainer.prompts_per_step - dropped)
    assert metrics["sampling/groups_kept"] == kept.groups
