"""Staleness bounded by admission, not by throwing work away (AReaL's and SkyRL's rule), in weight versions: a version
is the learner's count of optimizer updates (``Learner.version``), as pushed to the engines and reported with every
completion (``Trajectory.version``). ``rollout.max_staleness`` = S: a group started while the engines hold version v
trains at a step whose weights are at most v + S.

Admission counts groups, a step's ``batch`` at a time (``accepted``: groups that reached the buffer; one the filter
drops gives its place back), so the bound becomes a number of steps, here and nowhere else (``advance``): step t is
about to train with the learner at version L, the engines hold v (v < L between pushes, ``rollout.sync_every`` > 1),
and a step makes at most U = actor.mini_batches x actor.epochs updates, so step t + j starts at most at L + jU. A
generation starts only while

    accepted + running <= (t + floor((v + S - L) / U)) x batch

so a group started at v trains no later than step t + floor((v + S - L) / U), at most S versions after v. With U = 1
and the learner's weights pushed after each step (L = v = t - 1) that is ``(S + v + 1) x batch``. A step that makes
fewer updates (a critic's warm-up, a batch the filter emptied) only leaves groups fresher than the bound."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlcore.errors import ConfigError


@dataclass
class Admission:
    max_staleness: int        # S, in versions
    batch: int                # groups a step trains on
    updates_per_step: int = 1     # U: the most optimizer updates a step makes
    version: int = 0          # the engines' version when the last step was taken: what a group started now is tagged
    steps: int = field(init=False)    # the steps whose groups may be admitted, in all
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        self.advance(1, learner=0, engines=0)

    def advance(self, step: int, learner: int, engines: int) -> None:
        """Step ``step`` is about to train with the learner at version ``learner``; the engines hold ``engines``."""
        ahead = (engines + self.max_staleness - learner) // self.updates_per_step
        if ahead < 0:        # this step's own groups could never start: the run would wait forever
            raise ConfigError(f"step {step} trains at weight version {learner} while the rollout engines hold "
                              f"{engines}: more than rollout.max_staleness = {self.max_staleness} versions apart; a "
                              f"push every rollout.sync_every = K steps of up to {self.updates_per_step} optimizer "
                              f"updates each needs rollout.max_staleness >= (K - 1) x {self.updates_per_step}")
        self.version, self.steps = engines, step + ahead

    def capacity(self) -> int:
        """How many more groups may start now."""
        return max(0, self.steps * self.batch - self.accepted - self.running)

    def start(self, groups: int) -> None:
        self.running += groups

    def finish(self, kept: bool) -> None:
        self.running -= 1
        self.accepted += int(kept)

    def cancel(self, groups: int) -> None:
        """Groups started that will not finish (their worker died): started again later, admitted anew."""
        self.running -= groups

    def rebase(self, step: int, version: int, consumed: int) -> None:
        """After a resume from ``step`` (the learner's weights, ``version``, pushed): nothing runs, the groups consumed
        so far are the accepted ones (the buffer was lost)."""
        self.advance(step + 1, learner=version, engines=version)
        self.accepted, self.running = consumed, 0
