"""The queued source's ledger of drawn and taken prompts (pure logic over the real addition and dataset-like tasks'
contract): a run stopped with groups of later draws taken ahead of earlier ones resumes without training any group
twice or skipping one."""
import random

from rlcore.rollout.draws import DrawLedger
from rlcore.specs import Task


class Sampled(Task):
    """A task whose prompts come from a stateful sampler (as the dataset task's): draw order matters."""

    def __init__(self):
        self.next = 0

    def train_prompts(self, step, count):
        prompts = [(f"p{self.next + i}", {}) for i in range(count)]
        self.next += count
        return prompts

    def eval_prompts(self):
        return []

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def test_a_resume_trains_every_prompt_once():
    rng, batch = random.Random(0), 4
    task, ledger = Sampled(), DrawLedger(Sampled(), batch)
    ledger.task = task
    trained: list[str] = []
    in_flight: list[tuple[int, int, str]] = []
    for _ in range(3):                               # three draws ahead, groups taken out of order
        d, prompts = ledger.draw()
        in_flight += [(d, i, p) for i, p, _ in prompts]
    for _ in range(7):
        d, i, p = in_flight.pop(rng.randrange(len(in_flight)))
        ledger.take(d, i)
        trained.append(p)
    saved = ledger.state_dict()                      # the run is killed here: what was in flight is lost

    task2 = Sampled()
    task2.load_state_dict(saved["task"])
    resumed = DrawLedger(task2, batch)
    resumed.load_state_dict(saved)
    while len(trained) < 3 * batch + 4:
        d, prompts = resumed.draw()
        for i, p, _ in prompts:
            resumed.take(d, i)
            trained.append(p)
    assert sorted(trained, key=lambda p: int(p[1:])) == [f"p{k}" for k in range(len(trained))]
