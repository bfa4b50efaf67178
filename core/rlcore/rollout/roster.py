"""Async mode's rollout workers as a roster that loses, regains, gains and sheds members while the run goes on: the
one place the rollout side heals and resizes (``rlcore.rollout.producer`` and ``rlcore.rollout.queued`` ask it where
to send work and tell it what failed; ``rlcore scale`` asks it for another size).

A slot goes serving -> dead when a call on its worker fails with a death (killed, out of memory, node gone: the
handle's ``is_death``); with ``rollout.replace_dead`` a new worker starts in the slot (starting), then waits for the
learner's weights (joining), which the queued source pushes to every serving and joining worker at its next push
(reopening the push channel with the new members); after that push it serves. Its groups in flight on the dead one
are started again elsewhere from their prompts (the producer re-issues them: a group is trained whole or not at
all). A worker's own error (not a death) still stops the run, as does the last slot's replacement failing to start
(an error, or ``MAX_FAILED_STARTS`` deaths in a row: no crash loop). Each slot's worker has a generation, so that the
late failures of a dead worker's other calls are not taken for its replacement's.

``resize(n)``: a larger size adds slots, each starting as a replacement does; a smaller one retires slots (those not
serving yet first, then the newest): a retiring worker takes no new groups, finishes those it has (drains), then
stops (retired)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from rlcore.rollout.handles import EngineWorkers

log = logging.getLogger(__name__)

SERVING, STARTING, JOINING, RETIRING, DEAD, RETIRED = "serving", "starting", "joining", "retiring", "dead", "retired"
LIVE = (SERVING, STARTING, JOINING)
MAX_FAILED_STARTS = 3     # replacements of a slot in a row that may die starting (a start's error: none again)


@dataclass
class Slot:
    state: str = SERVING
    generation: int = 0       # which worker of the slot: 0 the first, +1 per replacement
    load: int = 0             # groups in flight on it
    failed_starts: int = 0    # replacements in a row that died starting; one that fails with an error ends the slot


class Roster:
    """The rollout workers' states, loads and counters, shared by the producer's thread and the loop's (under a lock
    of its own); ``on_change``: called when a worker may take work again (the producer's wake-up); ``on_fatal``:
    with the line that stops the run, when the last replacement failed to start."""

    def __init__(self, rollout: EngineWorkers, replace_dead: bool, on_change: Callable[[], None] = lambda: None,
                 on_fatal: Callable[[str], None] = lambda message: None):
        self.rollout, self.replace_dead, self.on_change, self.on_fatal = rollout, replace_dead, on_change, on_fatal
        self.slots = [Slot() for _ in range(rollout.world)]
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTED, 0)         # since the last ``metrics``
        self.stopped = False

    # --- where work goes ---------------------------------------------------------------------------------------------
    def pick(self, groups: int) -> tuple[int, int] | None:
        """The least loaded serving worker (slot, generation), charged ``groups``; None when none serves."""
        with self.lock:
            serving = [i for i, s in enumerate(self.slots) if s.state == SERVING]
            if not serving:
                return None
            slot = min(serving, key=lambda i: self.slots[i].load)
            self.slots[slot].load += groups
            return slot, self.slots[slot].generation

    def finished(self, slot: int, generation: int, groups: int = 1) -> None:
        """``groups`` ended on the worker (done, or lost with it); a retiring one stops once it has none."""
        with self.lock:
            s = self.slots[slot]
            if s.generation != generation:
                return
            s.load -= groups
            drained = s.state == RETIRING and s.load <= 0
        if drained:
            self._retire(slot, generation)

    def serving(self) -> list[tuple[int, int]]:
        """The serving workers (slot, generation)."""
        return self._in(SERVING)

    def members(self) -> list[tuple[int, int]]:
        """The workers a push goes to (slot, generation): those serving (retiring ones too: they finish their groups
        with the weights the others have) and those waiting for weights to serve."""
        return self._in(SERVING, RETIRING, JOINING)

    def _in(self, *states: str) -> list[tuple[int, int]]:
        with self.lock:
            return [(i, s.generation) for i, s in enumerate(self.slots) if s.state in states]

    def joining(self) -> bool:
        with self.lock:
            return any(s.state == JOINING for s in self.slots)

    def waiting_for_weights(self) -> bool:
        """Nobody serves and a new worker waits for the weights: only a push lets the run go on."""
        with self.lock:
            states = {s.state for s in self.slots}
            return SERVING not in states and JOINING in states

    def pushed(self, members: list[tuple[int, int]], version: int) -> None:
        """``members`` hold the learner's weights (``version``) now: those that joined serve."""
        with self.lock:
            joined = [i for i, g in members if self.slots[i].state == JOINING and self.slots[i].generation == g]
            for i in joined:
                self.slots[i].state = SERVING
        for i in joined:
            log.warning("rollout worker %d serving (weights v%d)", i, version)
        if joined:
            self.on_change()

    # --- failures ----------------------------------------------------------------------------------------------------
    def lost(self, slot: int, generation: int, error: BaseException) -> str | None:
        """A call on worker ``slot`` (its ``generation``) failed with ``error``. A death is healed (None): the slot is
        dead, a replacement starting if allowed; otherwise (the worker's own error; no worker left) the one line
        that stops the run."""
        what = self.rollout.failed(slot, error)
        if not self.rollout.is_death(error):
            return what
        with self.lock:
            s = self.slots[slot]
            if s.generation != generation or s.state in (DEAD, RETIRED):     # heard of already
                return self._none_left(what)
            replace = (self.replace_dead and s.state != RETIRING and s.failed_starts < MAX_FAILED_STARTS
                       and not self.stopped)
            s.state, s.load = (STARTING if replace else RETIRED if s.state == RETIRING else DEAD), 0
            if replace:
                s.generation += 1
                self.counts["restarts"] += 1
            message = self._none_left(what)
        if message is None:
            log.warning("%s; its requests go to the other rollout workers%s", what,
                        "; a replacement is starting" if replace else "")
        if replace:
            self._start(slot)
        return message

    def _ended(self, slot: int, error: BaseException) -> str | None:
        """A slot whose replacement failed to start (an error, or deaths ``MAX_FAILED_STARTS`` times in a row) stays
        empty; the line that stops the run if no worker is left."""
        what = self.rollout.failed(slot, error)
        with self.lock:
            self.slots[slot].state = DEAD
            stop = self._none_left(what)
        if stop is None:
            log.warning("%s starting; the slot stays empty", what)
        return stop

    def _none_left(self, what: str) -> str | None:
        if any(s.state in (*LIVE, RETIRING) for s in self.slots):
            return None
        return (f"{what}; no rollout worker is left (rollout.replace_dead={str(self.replace_dead).lower()}"
                f"{'' if self.replace_dead else ': set it true to replace dead workers'})")

    def reissued(self, requests: int) -> None:
        with self.lock:
            self.counts["requests_reissued"] += requests

    def _start(self, slot: int) -> None:
        """A new worker in ``slot``: joining once its engine is built."""
        with self.lock:
            generation = self.slots[slot].generation

        def started(where: dict | None, error: BaseException | None) -> None:
            with self.lock:
                s = self.slots[slot]
                if s.generation != generation or s.state != STARTING:    # retired meanwhile
                    return
                if error is None:
                    s.state, s.failed_starts = JOINING, 0
                else:
                    s.failed_starts = s.failed_starts + 1 if self.rollout.is_death(error) else MAX_FAILED_STARTS
                again = s.failed_starts < MAX_FAILED_STARTS
            if error is None:
                self.on_change()
                return
            stop = self.lost(slot, generation, error) if again else self._ended(slot, error)
            if stop is not None:
                self.on_fatal(stop)

        self.rollout.start_worker(slot, started)

    # --- size --------------------------------------------------------------------------------------------------------
    def resize(self, workers: int) -> None:
        """``workers`` live rollout workers from now: new slots start, or the surplus retires (``rlcore scale``)."""
        with self.lock:
            live = [i for i, s in enumerate(self.slots) if s.state in LIVE]
            surplus = sorted(live, key=lambda i: (self.slots[i].state == SERVING, -i))[:max(0, len(live) - workers)]
            added = list(range(len(self.slots), len(self.slots) + max(0, workers - len(live))))
            self.slots += [Slot(STARTING) for _ in added]
            idle = []
            for i in surplus:
                s = self.slots[i]
                if s.state == SERVING and s.load > 0:
                    s.state = RETIRING          # drains: no new groups
                else:
                    s.generation += 1           # a start under way is ignored when it ends
                    idle.append((i, s.generation))
            self.counts["workers_added"] += len(added)
            self.counts["workers_removed"] += len(surplus)
        if added or surplus:
            log.warning("rollout workers: %d live, %s", workers,
                        f"{len(added)} starting" if added else f"{len(surplus)} retiring")
        for i in added:
            self._start(i)
        for i, generation in idle:
            self._retire(i, generation, drained=False)

    def _retire(self, slot: int, generation: int, drained: bool = True) -> None:
        with self.lock:
            s = self.slots[slot]
            if s.generation != generation or s.state == RETIRED:
                return
            s.state = RETIRED
        log.warning("rollout worker %d retired%s", slot, " (drained)" if drained else "")
        self.rollout.stop_worker(slot)

    # --- reports -----------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Workers serving now; replacements started, requests re-issued, workers added and removed since the last
        call."""
        with self.lock:
            counts, self.counts = self.counts, dict.fromkeys(COUNTED, 0)
            alive = sum(s.state in (SERVING, RETIRING) for s in self.slots)
        return {"rollout/workers_alive": float(alive), **{f"rollout/{k}": float(v) for k, v in counts.items()}}

    def stop(self) -> None:
        """The run is stopping: no more replacements."""
        with self.lock:
            self.stopped = True


COUNTED = ("restarts", "requests_reissued", "workers_added", "workers_removed")
