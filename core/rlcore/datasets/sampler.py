"""Epochs over a dataset with a seeded shuffle per epoch. The position (epoch, offset) is the sampler's whole state:
stored with a checkpoint, it resumes the exact sequence of prompts."""
from __future__ import annotations

import random


class EpochSampler:
    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size < 1:
            raise ValueError("an epoch sampler needs at least one item")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices; an epoch that runs out continues into the next, freshly shuffled."""
        taken: list[int] = []
        while len(taken) < count:
            if self.offset == self.size:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            step = min(count - len(taken), self.size - self.offset)
            taken.extend(self._order[self.offset: self.offset + step])
            self.offset += step
        return taken

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["size"]) != (self.seed, self.size):
            raise ValueError(f"sampler state is for seed {state['seed']} over {state['size']} items; this sampler "
                             f"has seed {self.seed} over {self.size}")
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._epoch_order(self.epoch)
