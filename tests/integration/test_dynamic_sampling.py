"""Dynamic sampling (GRPO's algorithm.dynamic_sampling): groups whose rewards are all equal are dropped, more prompts
are sampled in their place, and every dropped group is counted."""
import pytest

from rlcore.timing import Timer
from rlcore.rollout.groups import GroupFilter
from rlcore.trajectory import Trajectory, to_batch


def groups(rewards_per_group, first=0):
    """Single-turn trajectories, one group per list of rewards; response token = its row number from ``first``."""
    out, row = [], first
    for rewards in rewards_per_group:
        group = []
        for r in rewards:
            group.append(Trajectory.single_turn([1], [row], [0.0], reward=float(r)))
            row += 1
        out.append(group)
    return out


def test_the_filter_keeps_groups_with_a_signal_renumbered_and_counts_the_rest():
    kept = GroupFilter(keep=lambda rewards: bool((rewards != rewards[0]).any()), wanted=3)
    kept.offer(groups([[1, 0], [1, 1], [0, 1]]))           # round 1: the middle group has no signal
    assert not kept.full and kept.dropped == 1
    kept.offer(groups([[0, 0], [0, 1], [1, 0]], first=6))  # round 2: one dropped, one kept, one beyond the batch
    assert kept.full and kept.dropped == 2
    trajectories = kept.trajectories()
    assert [t.group for t in trajectories] == [0, 0, 1, 1, 2, 2]
    assert [t.tokens[-1] for t in trajectories] == [0, 1, 4, 5, 8, 9]
    batch = to_batch(trajectories, pad_id=0)
    assert batch["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["rewards"].tolist() == [1, 0, 0, 1, 0, 1]


@pytest.mark.slow
def test_dynamic_sampling_keeps_only_groups_with_a_signal(quickstart):
    cfg = quickstart.cfg
    quickstart.algo_cfg.dynamic_sampling = True
    n = cfg.rollout.n
    cfg.rollout.n = 2          # pairs: often both right or both wrong, so some groups are dropped
    try:
        rollout = quickstart.source.next_groups(1, quickstart.learner.version, Timer())
        kept, sampled, metrics = rollout.trajectories, rollout.scores, rollout.metrics
    finally:
        quickstart.algo_cfg.dynamic_sampling = False
        cfg.rollout.n = n
    kept_groups = len({t.group for t in kept})
    assert [t.group for t in kept] == sorted(t.group for t in kept) == [g for g in range(kept_groups) for _ in "ab"]
    for g in range(kept_groups):
        r = [t.reward for t in kept if t.group == g]
        assert len(r) == 2 and r[0] != r[1], "a kept group has differing rewards"
    rounds, dropped = metrics["sampling/rounds"], metrics["sampling/groups_dropped"]
    # sampling stops as soon as the batch is full, or after the last allowed round
    assert kept_groups == cfg.trainer.prompts_per_step or rounds == cfg.rollout.max_sampling_rounds
    # everything sampled is accounted for: kept groups + dropped groups + groups beyond the batch's size
    assert len(sampled.total) == rounds * cfg.trainer.prompts_per_step * 2
    assert dropped >= 1, "pairs of samples are often both right or both wrong"
    assert kept_groups == min(cfg.trainer.prompts_per_step, rounds * cfg.trainer.prompts_per_step - dropped)
    assert metrics["sampling/groups_kept"] == kept_groups
