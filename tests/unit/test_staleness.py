"""Admission control (pure logic) with the queued source's consumer rule: a group that finished more than S versions
after its start is dropped (its place given back), so none trains more than S behind; the producer never stalls
while the consumer waits; and when groups finish in the order they started, admission alone keeps every group
within S (nothing dropped), and each step at S >= 1 has the next step's groups already in flight. Versions count
optimizer updates: with actor.mini_batches = 2 a step moves the weights two versions."""
import random

import pytest

from rlcore.errors import ConfigError
from rlcore.rollout.staleness import Admission


def versions(step: int, updates: int, sync_every: int) -> tuple[int, int]:
    """Before ``step``: the learner's version and the engines' (pushed after every ``sync_every``-th step), each step
    making ``updates`` optimizer updates."""
    pushed = (step - 1) // sync_every * sync_every
    return (step - 1) * updates, pushed * updates


def simulate(staleness: int, batch: int, pick, steps: int = 60, updates: int = 1,
             sync_every: int = 1) -> tuple[int, int]:
    """Steps of a producer and a consumer; ``pick(running)`` chooses which running group finishes next. Returns the
    largest lag trained (in versions) and how many groups were dropped for exceeding S."""
    admission = Admission(staleness, batch, updates)
    running: list[int] = []          # the version each running group started at, in start order
    worst = dropped = 0
    for step in range(1, steps + 1):
        learner, engines = versions(step, updates, sync_every)
        admission.advance(step, learner, engines)
        taken = 0
        while taken < batch:
            for _ in range(admission.capacity()):
                admission.start(1)
                running.append(admission.version)
            assert running, "the consumer waits and nothing runs: admission stalled"
            started = running.pop(pick(running))
            admission.finish(kept=True)
            if learner - started > staleness:
                dropped += 1
                admission.accepted -= 1
                continue
            worst = max(worst, learner - started)
            taken += 1
    return worst, dropped


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_groups_finishing_in_start_order_are_all_within_s(staleness):
    assert simulate(staleness, 4, lambda running: 0) == (staleness, 0)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_stragglers_beyond_s_are_dropped_never_trained(staleness):
    rng = random.Random(staleness)
    worst, dropped = simulate(staleness, 4, lambda running: rng.randrange(len(running)))
    assert worst <= staleness
    assert dropped > 0 or staleness == 0


@pytest.mark.parametrize("staleness, worst", [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4)])
def test_two_mini_batches_keep_every_group_within_s_versions(staleness, worst):
    """Two updates a step: a group one step behind is two versions behind, so S = 1 admits only the step's own
    groups (counted in steps, as before, it would have trained them two versions behind)."""
    assert simulate(staleness, 4, lambda running: 0, updates=2) == (worst, 0)
    rng = random.Random(staleness)
    trained, _ = simulate(staleness, 4, lambda running: rng.randrange(len(running)), updates=2)
    assert trained <= staleness


def test_two_mini_batches_pushed_every_other_step_stay_within_s():
    assert simulate(2, 4, lambda running: 0, updates=2, sync_every=2) == (2, 0)
    assert simulate(5, 4, lambda running: 0, updates=2, sync_every=2) == (4, 0)


def test_engines_further_behind_than_s_are_refused_not_waited_for():
    admission = Admission(1, 4, updates_per_step=2)
    with pytest.raises(ConfigError, match=r"rollout.max_staleness >= \(K - 1\) x 2"):
        admission.advance(3, learner=4, engines=2)


def test_rebase_after_a_resume_counts_the_consumed_groups():
    admission = Admission(1, 8)
    admission.start(16)
    admission.rebase(step=5, version=5, consumed=40)
    assert admission.capacity() == (1 + 5 + 1) * 8 - 40 == 16
    two = Admission(2, 8, updates_per_step=2)      # resumed after step 5 = 10 updates: one step ahead admitted
    two.rebase(step=5, version=10, consumed=40)
    assert two.version == 10 and two.capacity() == (5 + 1 + 1) * 8 - 40


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_taking_the_oldest_version_first_keeps_stragglers_within_s(staleness):
    """The queued source's rule: the consumer takes a finished group of the oldest version started (running or
    finished), waiting for a straggler rather than passing it by; then any completion order stays within S."""
    rng, batch, admission = random.Random(staleness), 4, Admission(staleness, 4)
    running: list[int] = []
    finished: list[int] = []
    worst = 0
    for step in range(1, 61):
        admission.advance(step, step - 1, step - 1)
        for _ in range(batch):
            while True:
                for _ in range(admission.capacity()):
                    admission.start(1)
                    running.append(admission.version)
                oldest = min(running + finished)
                if oldest in finished:
                    break
                finished.append(running.pop(rng.randrange(len(running))))     # any group may finish first
                admission.finish(kept=True)
            finished.remove(oldest)
            worst = max(worst, step - 1 - oldest)
    assert worst == staleness
