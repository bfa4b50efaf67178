"""``trainer.profile_steps``: for the listed steps, a torch profiler trace and a memory record per phase on every
worker rank, in ``<run dir>/profile/step<N>/<phase>-rank<r>.json`` (chrome trace; chrome://tracing, Perfetto, or
``json.load``) beside ``<phase>-rank<r>-memory.json``, and on a GPU ``<phase>-rank<r>-memory.pickle``
(``torch.cuda.memory._dump_snapshot``, for pytorch.org/memory_viz).

The driver's step timer marks the phases (``rlcore.loop``); on a profiled step a ``ProfilingTimer`` takes its place
and has the workers that do the phase's work (the actor's for rollout, sync, logprobs and train; the critic's for
values and critic) start a profiler when the phase begins and write it out when it ends. Other steps use the plain
timer: no profiler is created. A phase entered again within the step (another sampling round) gets ``-2``, ``-3``...
Async mode's rollout workers generate outside the step's phases and are not profiled; its trainer-side push is (sync).
"""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

import torch

from rlcore.timing import Timer

log = logging.getLogger(__name__)

ACTOR_PHASES = ("rollout", "sync", "logprobs", "train")
CRITIC_PHASES = ("values", "critic")


def _status_kib(key: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Linux resets VmHWM to the current RSS on writing 5 to clear_refs, so the peak is the phase's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseProfiler:
    """One phase's profiler in one worker process: ``begin`` starts it, ``end`` writes the trace and memory record."""

    def __init__(self, path: str):
        self.path = path                     # <run dir>/profile/step<N>/<phase>-rank<r>, without the suffix
        self.cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda
                                                               else [])
        self.profiler = torch.profiler.profile(activities=activities, profile_memory=True)
        self.memory: dict[str, Any] = {}

    def begin(self) -> None:
        self.memory = {"rss_begin_bytes": (_status_kib("VmRSS") or 0) * 1024, "peak_is_phase": _reset_peak_rss()}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.memory["cuda_allocated_begin_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.start = time.perf_counter()
        self.profiler.start()

    def end(self) -> list[str]:
        """Stop and write; returns the files written."""
        self.profiler.stop()
        seconds = time.perf_counter() - self.start
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        written = [f"{self.path}.json"]
        self.profiler.export_chrome_trace(written[0])
        memory = {**self.memory, "seconds": seconds, "rss_end_bytes": (_status_kib("VmRSS") or 0) * 1024,
                  # the process's peak RSS during the phase (since its start, where the reset is not allowed)
                  "rss_peak_bytes": (_status_kib("VmHWM") or 0) * 1024,
                  "top_cpu_memory_ops": _top_memory_ops(self.profiler, "self_cpu_memory_usage")}
        if self.cuda:
            written.append(f"{self.path}-memory.pickle")
            torch.cuda.memory._dump_snapshot(written[-1])
            torch.cuda.memory._record_memory_history(enabled=None)
            memory.update(cuda_allocated_end_bytes=torch.cuda.memory_allocated(),
                          cuda_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                          cuda_reserved_bytes=torch.cuda.memory_reserved(),
                          top_cuda_memory_ops=_top_memory_ops(self.profiler, "self_device_memory_usage"))
        written.append(f"{self.path}-memory.json")
        with open(written[-1], "w") as f:
            json.dump(memory, f, indent=2)
        return written


def _top_memory_ops(profiler, field: str, count: int = 10) -> list[dict]:
    """The operators that allocated the most (bytes allocated minus freed by the operator itself)."""
    rows = [(e.key, getattr(e, field, 0), e.count) for e in profiler.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:count]
    return [{"op": key, "bytes": int(size), "calls": calls} for key, size, calls in rows]


class Workers(Protocol):
    """A phase's workers as the driver calls them (``rlcore.workers.proxies.TrainGroup``); ``phase``: what a
    message about a worker dying in the call calls it."""

    def profile_begin(self, directory: str, name: str, phase: str) -> None: ...

    def profile_end(self, phase: str) -> list[list[str]]: ...


class ProfilingTimer(Timer):
    """The step timer of a profiled step: times phases as ``Timer`` does and profiles the workers' ones (profiling
    included in their seconds)."""

    def __init__(self, directory: str, actor: Workers, critic: Workers | None):
        super().__init__()
        self.directory = directory
        self.groups = {**{p: actor for p in ACTOR_PHASES}, **({p: critic for p in CRITIC_PHASES} if critic else {})}
        self.entered: dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        with super().__call__(phase):
            group = self.groups.get(phase)
            if group is None:
                yield
                return
            self.entered[phase] = self.entered.get(phase, 0) + 1
            name = phase if self.entered[phase] == 1 else f"{phase}-{self.entered[phase]}"
            group.profile_begin(self.directory, name, phase=f"profiling {phase}")
            yield              # a phase that raises stops the run: nothing to write then
            written = group.profile_end(phase=f"profiling {phase}")
            log.info("profiled %s on %d rank(s): %s/%s-rank*", name, len(written), self.directory, name)


def profile_directory(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "profile", f"step{step}")
