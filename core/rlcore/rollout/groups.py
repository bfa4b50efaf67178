"""Which groups of trajectories reach the learner: dynamic sampling is a filter on the stream of groups, counted."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlcore.trajectory import Trajectory


@dataclass
class GroupFilter:
    """Keeps the groups ``keep(rewards)`` accepts (the algorithm's ``keep_group``), the first ``wanted`` of them,
    numbered 0.. in the order they came; every group it refuses is counted in ``dropped``."""
    keep: Callable[[torch.Tensor], bool]
    wanted: int
    kept: list[list[Trajectory]] = field(default_factory=list)
    dropped: int = 0

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.wanted

    def accepts(self, group: list[Trajectory]) -> bool:
        """Whether ``keep`` accepts the group's rewards; one it refuses is counted in ``dropped``."""
        if self.keep(torch.tensor([t.reward for t in group], dtype=torch.float32)):
            return True
        self.dropped += 1
        return False

    def offer(self, groups: list[list[Trajectory]]) -> None:
        """Keep the accepted groups while there is room."""
        for group in groups:
            if self.accepts(group) and not self.full:   # one with a signal beyond the batch: neither kept nor dropped
                for t in group:
                    t.group = len(self.kept)
                self.kept.append(group)

    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.kept for t in group]
