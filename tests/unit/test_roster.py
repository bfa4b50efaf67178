"""The rollout roster's rules (``rlcore.rollout.roster``), on a stand-in for the Ray handle: which deaths are healed,
when a replacement serves, when the run must stop, that a dead worker's late failures are not taken for its
replacement's, and how a run grows and shrinks. The real workers are killed in tests/e2e/test_async_healing.py."""
from rlcore.rollout.roster import MAX_FAILED_STARTS, Roster


class Died(Exception):
    pass


class Workers:
    """What the healer calls on the rollout workers: starts resolve when the test says."""

    def __init__(self, world: int):
        self.world = world
        self.where = [{"pid": 100 + i, "host": "h"} for i in range(world)]
        self.starts: list[tuple[int, Start]] = []
        self.stopped: list[int] = []

    def failed(self, index, error):
        return f"rollout worker {index} {'died' if self.is_death(error) else 'failed'}"

    def is_death(self, error):
        return isinstance(error, Died)

    def start_worker(self, index, started):
        self.starts.append((index, Start(started)))

    def stop_worker(self, index):
        self.stopped.append(index)


class Start:
    """A worker's start, ended by the test (on the real handle: by a thread of its own)."""

    def __init__(self, started):
        self.started = started

    def set_result(self, where):
        self.started(where, None)

    def set_exception(self, error):
        self.started(None, error)


def roster(world=2, replace=True):
    workers, events = Workers(world), []
    return workers, Roster(workers, replace, on_change=lambda: events.append("change"),
                           on_fatal=events.append), events


def test_a_dead_worker_is_replaced_and_serves_after_a_push():
    workers, h, events = roster()
    assert h.pick(3) == (0, 0) and h.pick(1) == (1, 0) and h.pick(1) == (1, 0)     # least loaded
    assert h.lost(0, 0, Died()) is None
    assert h.serving() == [(1, 0)] and h.members() == [(1, 0)]
    [(slot, start)] = workers.starts
    start.set_result({"pid": 7, "host": "h"})
    assert h.joining() and h.members() == [(0, 1), (1, 0)] and h.serving() == [(1, 0)]
    assert events == ["change"]
    h.pushed(h.members(), 3)
    assert h.serving() == [(0, 1), (1, 0)] and not h.joining()
    assert h.metrics() == {"rollout/workers_alive": 2.0, "rollout/restarts": 1.0, "rollout/requests_reissued": 0.0,
                           "rollout/workers_added": 0.0, "rollout/workers_removed": 0.0}
    assert h.metrics()["rollout/restarts"] == 0.0          # counted once


def test_late_failures_of_a_dead_worker_are_not_its_replacements():
    workers, h, _ = roster()
    assert h.lost(0, 0, Died()) is None and h.lost(0, 0, Died()) is None      # its other calls fail too
    assert len(workers.starts) == 1
    workers.starts[0][1].set_result({"pid": 7, "host": "h"})
    h.pushed(h.members(), 3)
    assert h.lost(0, 0, Died()) is None and h.serving() == [(0, 1), (1, 0)]


def test_a_workers_own_error_stops_the_run():
    _, h, _ = roster()
    assert h.lost(1, 0, RuntimeError("the engine broke")) == "rollout worker 1 failed"


def test_without_replacements_the_run_stops_when_the_last_worker_dies():
    workers, h, _ = roster(replace=False)
    assert h.lost(0, 0, Died()) is None and not workers.starts
    stop = h.lost(1, 0, Died())
    assert stop is not None and "no rollout worker is left (rollout.replace_dead=false: set it true" in stop


def test_nobody_serving_while_a_replacement_waits_for_weights():
    workers, h, _ = roster(world=1)
    assert h.lost(0, 0, Died()) is None and h.pick(1) is None and not h.waiting_for_weights()
    workers.starts[0][1].set_result({"pid": 7, "host": "h"})
    assert h.waiting_for_weights()


def test_replacements_that_keep_dying_while_starting_end_the_slot():
    workers, h, events = roster(world=1)
    assert h.lost(0, 0, Died()) is None
    for attempt in range(MAX_FAILED_STARTS):
        workers.starts[attempt][1].set_exception(Died())
    assert len(workers.starts) == MAX_FAILED_STARTS                 # retried, then not again
    assert len(events) == 1 and "no rollout worker is left" in events[0]


def test_a_replacement_whose_start_fails_with_an_error_is_not_retried():
    workers, h, events = roster()
    assert h.lost(0, 0, Died()) is None
    workers.starts[0][1].set_exception(RuntimeError("no engine"))
    assert len(workers.starts) == 1 and not events and h.members() == [(1, 0)]


def test_a_larger_size_starts_new_slots_that_serve_after_a_push():
    workers, h, _ = roster()
    h.resize(3)
    [(slot, start)] = workers.starts
    assert slot == 2 and h.members() == [(0, 0), (1, 0)]
    start.set_result({"pid": 9, "host": "h"})
    h.pushed(h.members(), 5)
    assert h.serving() == [(0, 0), (1, 0), (2, 0)]
    assert h.metrics()["rollout/workers_added"] == 1.0


def test_a_smaller_size_drains_the_newest_busy_worker_and_stops_idle_ones_at_once():
    workers, h, _ = roster(world=3)
    assert h.pick(2) == (0, 0) and h.pick(1) == (1, 0) and h.pick(1) == (2, 0)
    h.resize(2)                                     # the newest, busy: drains, still pushed to, takes no new groups
    assert h.serving() == [(0, 0), (1, 0)] and h.members() == [(0, 0), (1, 0), (2, 0)] and not workers.stopped
    assert h.metrics()["rollout/workers_alive"] == 3.0
    h.finished(2, 0)
    assert workers.stopped == [2] and h.members() == [(0, 0), (1, 0)]
    h.resize(1)                                     # the newest live one (busy: it drains)
    assert workers.stopped == [2] and h.serving() == [(0, 0)]
    h.finished(1, 0)
    assert workers.stopped == [2, 1]
    h.resize(2)
    assert [slot for slot, _ in workers.starts] == [3]


def test_retiring_a_slot_still_starting_ignores_its_start():
    workers, h, _ = roster()
    h.resize(3)
    h.resize(2)                                     # the one not serving yet goes first
    assert workers.stopped == [2]
    workers.starts[0][1].set_result({"pid": 9, "host": "h"})
    assert not h.joining() and h.serving() == [(0, 0), (1, 0)]
