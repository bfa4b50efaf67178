"""The loop's seam (issue 38), as pure logic: each step asks the source for the step's trajectories at the learner's
version, trains on them, hands the learner's weights (a handle, never tensors) to the source at the version the
update left, and runs the cadence after; a step whose filter kept nothing trains nothing and still hands the weights
on. Stand-ins for the three parts record what they were asked; the real parts run in the e2e tier."""
import torch

from rlcore import loop
from rlcore.rewards import Scores
from rlcore.rollout.source import StepRollout
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory


class Source:
    pad_id = 0

    def __init__(self, empty_steps=()):
        self.calls, self.empty_steps = [], set(empty_steps)

    def next_groups(self, step, version, timer):
        self.calls.append(("next_groups", step, version))
        kept = [] if step in self.empty_steps else \
            [Trajectory.single_turn([1, 2], [3], [-0.5], group=g, reward=float(g)) for g in range(2)]
        return StepRollout(kept, Scores(torch.tensor([0.0, 1.0])), {"sampling/groups_kept": float(len(kept))})

    def trajectory_metrics(self, trajectories):
        return {"agent/turns_mean": 1.0}

    def push_weights(self, weights, version, step, timer=None):
        self.calls.append(("push_weights", weights, version, step))
        return {"sync/bytes": 8.0}


class Learner:
    def __init__(self, updates_per_step):
        self.version, self.updates_per_step, self.batches = 0, updates_per_step, []

    def weights(self):
        return "the actor's workers"

    def update(self, batch, step, timer):
        self.batches.append(len(batch))
        self.version += self.updates_per_step
        return {"actor/pg_loss": 0.0}


class Cadence:
    def __init__(self, stop_after=None):
        self.calls, self.stop_after = [], stop_after

    def begin(self, step):
        self.calls.append(("begin", step))

    def timer(self, step):
        return Timer()

    def rollout_end(self, step, batch):
        self.calls.append(("rollout_end", step))

    def after(self, step, metrics):
        self.calls.append(("after", step, sorted(metrics)))

    def stopping(self, step):
        return step == self.stop_after


def test_each_step_samples_at_the_learners_version_and_hands_on_the_updated_weights():
    source, learner, cadence = Source(), Learner(updates_per_step=2), Cadence()
    loop.train(source, learner, cadence, done=1, steps=3)       # resumed after step 1: steps 2 and 3
    weights = "the actor's workers"
    assert source.calls == [("next_groups", 2, 0), ("push_weights", weights, 2, 2),
                            ("next_groups", 3, 2), ("push_weights", weights, 4, 3)]
    assert learner.batches == [2, 2]
    assert [c[:2] for c in cadence.calls] == [("begin", 2), ("rollout_end", 2), ("after", 2),
                                             ("begin", 3), ("rollout_end", 3), ("after", 3)]
    logged = cadence.calls[2][2]
    for key in ("sampling/groups_kept", "reward/mean", "actor/pg_loss", "response/length_mean", "agent/turns_mean",
                "sync/bytes", "time/step"):
        assert key in logged, key


def test_a_step_with_nothing_kept_trains_nothing_and_still_hands_on_the_weights():
    source, learner, cadence = Source(empty_steps={1}), Learner(updates_per_step=1), Cadence()
    metrics = loop.step(source, learner, cadence, 1)
    assert metrics["sampling/skipped_update"] == 1.0 and learner.batches == []
    assert source.calls[-1] == ("push_weights", "the actor's workers", 0, 1)
    assert cadence.calls == []          # no batch: no rollout_end hook


def test_a_run_asked_to_stop_stops_after_the_step_the_cadence_says():
    source, learner, cadence = Source(), Learner(updates_per_step=1), Cadence(stop_after=2)
    loop.train(source, learner, cadence, done=0, steps=5)
    assert [c[:2] for c in cadence.calls if c[0] == "after"] == [("after", 1), ("after", 2)]
    assert source.calls[-1] == ("push_weights", "the actor's workers", 2, 2)      # step 2 whole, then no step 3
