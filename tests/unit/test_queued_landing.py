"""A push the rollout workers are still loading (async mode, rollout.max_staleness >= 1) lands at the learner's next
push (``QueuedSource._land``). A receiver that died meanwhile is healed, and the others, whose loads then fail at the
push's end (an echo of that death; their engines stay paused), make the push go again at once; a landing whose
receivers all loaded it does not, and a receiver's own failure stops the run with its line. Pure logic: ``ray.get``
and the roster are stand-ins (the async e2e tests and bench/rollout_healing.py's smoke run the real thing)."""
import pytest
import ray
from ray.exceptions import ActorDiedError

from rlcore.errors import WorkerDied
from rlcore.rollout.queued import Landing, QueuedSource
from rlcore.weight_sync.push import WeightPushError

MEMBERS = [(0, 0), (1, 0)]      # (slot, generation)


class Roster:
    def __init__(self):
        self.pushed_to, self.lost_slots = [], []

    def pushed(self, members, version):
        self.pushed_to.append((members, version))

    def lost(self, slot, generation, error):
        """A death is healed (no line); a worker's own error is the line that stops the run."""
        self.lost_slots.append(slot)
        return None if isinstance(error, ActorDiedError) else f"rollout worker {slot} failed: {error}"


class Producer:
    def __init__(self):
        self.failed = None

    def fail(self, line):
        self.failed = line


def landing_source(monkeypatch, *outcomes):
    """A queued source whose last push is still loading on MEMBERS, each load ending as its outcome (a result, or an
    exception raised from ray.get)."""
    def get(outcome):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(ray, "get", get)
    source = QueuedSource.__new__(QueuedSource)
    source.roster, source.producer = Roster(), Producer()
    source.landing, source.pushed = Landing(MEMBERS, list(outcomes)), 3
    return source


def test_a_landing_every_receiver_loaded_is_not_pushed_again(monkeypatch):
    source = landing_source(monkeypatch, {"pause_seconds": 0.02}, {"pause_seconds": 0.05})
    metrics = {}
    assert source._land(metrics) is False
    assert source.roster.pushed_to == [(MEMBERS, 3)] and source.roster.lost_slots == []
    assert metrics == {"sync/pause_seconds": 0.05}
    assert source.landing is None and source._land({}) is False      # landed once


def test_a_receiver_dead_during_the_load_is_healed_and_the_push_goes_again(monkeypatch):
    echo = WeightPushError("weight push v3: the sender (channel rank 0 at 10.0.0.1:5000) failed: Connection reset")
    source = landing_source(monkeypatch, ActorDiedError(), echo)
    metrics = {}
    assert source._land(metrics) is True
    assert source.roster.lost_slots == [0]             # the dead one only: the echo is not a failure of its own
    assert source.roster.pushed_to == [([], 3)] and metrics == {}
    assert source.producer.failed is None


def test_a_receivers_own_failure_stops_the_run_with_its_line(monkeypatch):
    source = landing_source(monkeypatch, {"pause_seconds": 0.02}, RuntimeError("vLLM: unknown weight name"))
    with pytest.raises(WorkerDied, match="rollout worker 1 failed: vLLM: unknown weight name"):
        source._land({})
    assert source.producer.failed == "rollout worker 1 failed: vLLM: unknown weight name"
