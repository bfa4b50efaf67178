"""A worker whose model waits in host memory between its passes (the critic, a reward model): it wakes for them
and sleeps after, as its config section's ``offload`` says, so that the actor and the engine have the device."""
from __future__ import annotations

from contextlib import contextmanager

from rlcore.workers.worker import Worker


class OffloadingWorker(Worker):
    """Its subclass sets ``trainable`` and ``offloaded`` (``offloaded_parts`` of its section's ``offload``)."""
    offloaded: list[str]

    def wake(self) -> None:
        """Bring back what ``sleep`` moved to host memory, before the model's passes."""
        for what in reversed(self.offloaded):
            self.trainable.onload(what)

    def sleep(self) -> None:
        """Move what the section's ``offload`` names to host memory while the actor and the engine run."""
        for what in self.offloaded:
            self.trainable.offload(what)

    @contextmanager
    def awake(self):
        """The model in memory for a while (a checkpoint save or load), asleep again after."""
        self.wake()
        try:
            yield
        finally:
            self.sleep()

    def save_checkpoint(self, directory: str, asynchronous: bool = False) -> None:
        with self.awake():     # an asynchronous save's writer has its snapshot once this returns
            super().save_checkpoint(directory, asynchronous)

    def load_checkpoint(self, directory: str) -> dict:
        with self.awake():
            return super().load_checkpoint(directory)

