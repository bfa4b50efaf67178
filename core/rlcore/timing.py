"""The step timer, in a module of its own: the driver loop, the learner and the workers' profiler
(``rlcore.profiling``) all use it, and a worker process must not import the driver loop to get it."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Timer:
    """Seconds per phase of a step (``time/<phase>`` in its metrics)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
