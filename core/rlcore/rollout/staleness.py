"""Staleness bounded by admission, not by throwing work away (AReaL's and SkyRL's rule): a generation starts only
while ``accepted + running <= (S + version + 1) x batch``, counting groups. ``version`` is the weight version the
rollout side samples with, in steps (the learner's after ``version`` steps); ``accepted`` counts the groups that
reached the buffer (a group the filter drops gives its place back). A group started at version v is then trained
no later than step v + S + 1, i.e. at most S versions behind the weights that started it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    max_staleness: int
    batch: int                # groups a step trains on
    version: int = 0
    accepted: int = 0
    running: int = 0

    def capacity(self) -> int:
        """How many more groups may start now."""
        return max(0, (self.max_staleness + self.version + 1) * self.batch - self.accepted - self.running)

    def start(self, groups: int) -> None:
        self.running += groups

    def finish(self, kept: bool) -> None:
        self.running -= 1
        self.accepted += int(kept)

    def rebase(self, version: int, consumed: int) -> None:
        """After a resume: nothing runs, the groups consumed so far are the accepted ones (the buffer was lost)."""
        self.version, self.accepted, self.running = version, consumed, 0
