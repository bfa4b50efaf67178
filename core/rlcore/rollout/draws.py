"""Which training prompts the queued source has drawn, and which of their groups the learner has taken (trained,
or dropped by the filter, for staleness or a timeout): what a checkpoint saves, so that a resumed run neither
trains a group twice nor skips one it never trained, whatever ran ahead of the learner when it stopped.

Draw d is ``task.train_prompts(d, batch)``, as the colocated source's first round of step d. The task's state is
kept from before each draw not wholly taken: a checkpoint saves the one before the first such draw (the task's
sampler may have run ahead), and the groups of later draws taken already, which the resumed run skips."""
from __future__ import annotations

from rlcore.specs import Task


class DrawLedger:
    def __init__(self, task: Task, batch: int):
        self.task, self.batch = task, batch
        self.drawn = 0                            # draws made
        self.done = 0                             # draws 1..done had every group taken
        self.task_before: dict[int, dict] = {}    # the task's state before each draw after done
        self.taken: dict[int, set[int]] = {}      # per draw after done: the prompts whose groups were taken

    def draw(self) -> tuple[int, list[tuple[int, str, dict]]]:
        """The next draw's number and its (index, prompt, metadata) not taken yet (all but after a resume)."""
        self.drawn += 1
        self.task_before[self.drawn] = self.task.state_dict()
        prompts = self.task.train_prompts(self.drawn, self.batch)
        taken = self.taken.setdefault(self.drawn, set())
        return self.drawn, [(i, p, m) for i, (p, m) in enumerate(prompts) if i not in taken]

    def take(self, draw: int, index: int) -> None:
        self.taken.setdefault(draw, set()).add(index)
        while self.done < self.drawn and len(self.taken.get(self.done + 1, ())) >= self.batch:
            self.done += 1
            self.taken.pop(self.done)
            self.task_before.pop(self.done, None)

    def state_dict(self) -> dict:
        first = self.done + 1
        task = self.task_before[first] if first in self.task_before else self.task.state_dict()
        return {"task": task, "draws_done": self.done,
                "taken": sorted([d, i] for d, indices in self.taken.items() for i in indices)}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state`` (the task's own state is restored by the caller, from ``state["task"]``)."""
        self.drawn = self.done = state["draws_done"]
        self.task_before = {}
        self.taken = {}
        for d, i in state["taken"]:
            self.taken.setdefault(d, set()).add(i)
