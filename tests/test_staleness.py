"""Admission control (pure logic) with the queued source's consumer rule: a group that finished more than S versions
after its start is dropped (its place given back), so none trains more than S behind; the producer never stalls
while the consumer waits; and when groups finish in the order they started, admission alone keeps every group
within S (nothing dropped), and each step at S >= 1 has the next step's groups already in flight."""
import random

import pytest

from rlcore.rollout.staleness import Admission


def simulate(staleness: int, batch: int, pick, steps: int = 60) -> tuple[int, int]:
    """Steps of a producer and a consumer; ``pick(running)`` chooses which running group finishes next. Returns the
    largest lag trained and how many groups were dropped for exceeding S."""
    admission = Admission(staleness, batch)
    running: list[int] = []          # the version each running group started at, in start order
    worst = dropped = 0
    for step in range(1, steps + 1):
        admission.version = step - 1
        taken = 0
        while taken < batch:
            for _ in range(admission.capacity()):
                admission.start(1)
                running.append(admission.version)
            assert running, "the consumer waits and nothing runs: admission stalled"
            started = running.pop(pick(running))
            admission.finish(kept=True)
            if step - 1 - started > staleness:
                dropped += 1
                admission.accepted -= 1
                continue
            worst = max(worst, step - 1 - started)
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


def test_rebase_after_a_resume_counts_the_consumed_groups():
    admission = Admission(1, 8)
    admission.start(16)
    admission.rebase(version=5, consumed=40)
    assert admission.capacity() == (1 + 5 + 1) * 8 - 40 == 16


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_taking_the_oldest_version_first_keeps_stragglers_within_s(staleness):
    """The queued source's rule: the consumer takes a finished group of the oldest version started (running or
    finished), waiting for a straggler rather than passing it by; then any completion order stays within S."""
    rng, batch, admission = random.Random(staleness), 4, Admission(staleness, 4)
    running: list[int] = []
    finished: list[int] = []
    worst = 0
    for step in range(1, 61):
        admission.version = step - 1
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
