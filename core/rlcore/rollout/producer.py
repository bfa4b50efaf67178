"""Async mode's producer: an asyncio loop on a thread of the driver that keeps groups in flight on the rollout
workers as far as admission allows (``rlcore.rollout.staleness``) and puts each finished group into a buffer, which
the queued source (``rlcore.rollout.queued``) takes from on the loop's thread. Everything the two threads share
(the buffer, what runs, admission, the draw ledger, the first error) is read and written under ``changed``. A group
whose worker dies before it finishes is started again on another (``rlcore.rollout.roster``), from its prompt and
seeds: trained whole once, or not at all."""
from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Callable

from rlcore.config import Config
from rlcore.errors import WorkerDied
from rlcore.rollout.draws import DrawLedger
from rlcore.rollout.handles import EngineWorkers
from rlcore.rollout.roster import Roster
from rlcore.rollout.source import prompt_seeds
from rlcore.rollout.staleness import Admission
from rlcore.specs import Sampling, Task
from rlcore.trajectory import Trajectory


# each episode's metadata names the prompt its group came from, "<draw>/<index>": whatever dies, resumes or is
# re-issued, a run trains each at most once (the ledger a test of healing checks, from the batches)
PROMPT_ID = "prompt_id"


@dataclass
class Produced:
    group: list[Trajectory]
    draw: int                 # which draw of prompts, and which prompt of it: the order a step's groups train in
    index: int
    version: int              # the engines' weight version admission tagged it with at its start (Admission.version)


class Producer:
    """Draws prompts as the colocated source draws a step's first round (draw d: ``task.train_prompts(d, batch)``,
    seeded ``prompt_seeds(.., "train", d, 1)``) and starts their groups on the least loaded rollout worker."""

    def __init__(self, cfg: Config, rollout: EngineWorkers, roster: Roster, task: Task,
                 encode: Callable[[str, dict], tuple[list[int], dict]], sampling: Sampling):
        """``encode``: a row's prompt text and metadata -> its tokens and its episodes' metadata
        (``Source.encode_prompt``); ``sampling``: how every request samples; ``roster``: which workers serve."""
        self.cfg, self.rollout, self.encode, self.sampling = cfg, rollout, encode, sampling
        self.roster = roster
        roster.on_change, roster.on_fatal = self._roster_changed, self.fail
        self.batch = cfg.trainer.prompts_per_step
        self.admission = Admission(cfg.rollout.max_staleness, self.batch, cfg.actor.mini_batches * cfg.actor.epochs)
        self.buffer: collections.deque[Produced] = collections.deque()
        self.running: collections.Counter[int] = collections.Counter()   # groups generating, by admission version
        self.changed = threading.Condition()
        self.error: str | None = None             # what stopped the rollout side, in one line
        self.ledger = DrawLedger(task, self.batch)   # drawn prompts and taken groups
        self.waiting: list[tuple[list[int], dict, int, int, int]] = []   # prompts of the draw not started yet
        self.counts = {"tokens": 0, "timed_out": 0}   # since the consumer's last ``counted``
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None

    # --- the producer's thread -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlcore-producer", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._produce(), self.loop)

    async def _produce(self) -> None:
        self.wake = asyncio.Event()
        try:
            while True:
                with self.changed:
                    wave = self._next_prompts(self.admission.capacity()) if self.roster.serving() else []
                    self.admission.start(len(wave))
                    version = self.admission.version
                    self.running[version] += len(wave)
                picked = self.roster.pick(len(wave)) if wave else None
                if picked is None:
                    self._requeue(wave, version)       # nobody serves (a worker died just now): started later
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                asyncio.ensure_future(self._generate(*picked, wave, version))
        except asyncio.CancelledError:
            raise
        except BaseException as e:    # the consumer hears of it
            self.fail(f"the rollout producer failed: {type(e).__name__}: {e}")

    def _next_prompts(self, count: int) -> list[tuple[list[int], dict, int, int, int]]:
        """Up to ``count`` prompts of the current draw (new draws when it is used up): (tokens, metadata, seed,
        draw, index)."""
        while count and not self.waiting:
            draw, prompts = self.ledger.draw()
            seeds = prompt_seeds(self.batch, self.cfg.run.seed, "train", draw, 1)
            self.waiting = [(*self._encoded(p, m, f"{draw}/{i}"), seeds[i], draw, i) for i, p, m in prompts]
        wave, self.waiting = self.waiting[:count], self.waiting[count:]
        return wave

    def _encoded(self, text: str, metadata: dict, prompt_id: str) -> tuple[list[int], dict]:
        tokens, metadata = self.encode(text, metadata)
        return tokens, {**metadata, PROMPT_ID: prompt_id}

    async def _generate(self, worker: int, generation: int, wave: list, version: int) -> None:
        finished: set[int] = set()
        try:
            stream = self.rollout.stream_groups(worker, [p for p, *_ in wave], [m for _, m, *_ in wave],
                                                self.cfg.rollout.n, self.sampling, [s for _, _, s, *_ in wave],
                                                f"d{wave[0][3]}-{wave[0][4]}")
            async for ref in stream:
                i, group = await ref
                finished.add(i)
                _, _, _, draw, index = wave[i]
                with self.changed:
                    self.running[version] -= 1
                    if group is None:           # past rollout.request_timeout: dropped, its place given back
                        self.counts["timed_out"] += 1
                        self.ledger.take(draw, index)
                        self.admission.finish(kept=False)
                    else:
                        self.buffer.append(Produced(group, draw, index, version))
                        self.admission.finish(kept=True)
                        self.counts["tokens"] += sum(sum(t.loss_mask) for t in group)
                    self.changed.notify_all()
                self.roster.finished(worker, generation)
                self.poke()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            stop = self.roster.lost(worker, generation, e)
            if stop is not None:
                self.fail(stop)
                return
            lost = [w for i, w in enumerate(wave) if i not in finished]
            self._requeue(lost, version)
            self.roster.reissued(len(lost) * self.cfg.rollout.n)

    def _requeue(self, wave: list, version: int) -> None:
        """Groups of ``wave`` that will not finish where they started: first in line to start again (their places
        in admission given back until then)."""
        if not wave:
            return
        with self.changed:
            self.running[version] -= len(wave)
            self.admission.cancel(len(wave))
            self.waiting[:0] = wave
        self.poke()

    # --- from any thread -------------------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        """The rollout side has stopped: the consumer's next take raises ``message`` (the first one said)."""
        with self.changed:
            self.error = self.error or message
            self.changed.notify_all()

    def poke(self) -> None:
        """Tell the producer that admission may have room now."""
        if self.loop is not None and self.wake is not None:
            self.loop.call_soon_threadsafe(self.wake.set)

    def _roster_changed(self) -> None:
        """A worker joined or serves again: the producer may start groups, the consumer may have to push."""
        with self.changed:
            self.changed.notify_all()
        self.poke()

    # --- the consumer's side ---------------------------------------------------------------------------------------
    def advance(self, step: int, learner: int, engines: int) -> None:
        """Step ``step`` is about to train with the learner at version ``learner``, the engines at ``engines``
        (``Admission.advance``); the producer is started at the first step."""
        if self.loop is None:
            self.start()
        with self.changed:
            self.admission.advance(step, learner, engines)
        self.poke()

    def take(self) -> tuple[Produced, int] | None:
        """A finished group of the oldest version started (waiting for one: a straggler is waited for, not passed
        by newer groups, which would leave it past the staleness bound), and how many were in the buffer; None
        while no worker serves and a new one waits for the weights (only the consumer can push them)."""
        with self.changed:
            while (at := self._oldest()) is None and self.error is None:
                if self.roster.waiting_for_weights():
                    return None
                self.changed.wait()
            if self.error is not None or at is None:
                raise WorkerDied(str(self.error))
            depth = len(self.buffer)
            produced = self.buffer[at]
            del self.buffer[at]
            self.ledger.take(produced.draw, produced.index)
            return produced, depth

    def _oldest(self) -> int | None:
        """Where in the buffer the first finished group of the oldest version among those running or finished is,
        if one of that version has finished."""
        versions = [v for v, count in self.running.items() if count > 0] + [p.version for p in self.buffer]
        oldest = min(versions, default=None)
        return next((i for i, p in enumerate(self.buffer) if p.version == oldest), None)

    def give_back(self) -> None:
        """A group that will not train gives its place in the admission count back."""
        with self.changed:
            self.admission.accepted -= 1
        self.poke()

    def counted(self) -> dict[str, int]:
        """Response tokens generated and groups timed out since the last call."""
        with self.changed:
            counts, self.counts = self.counts, {"tokens": 0, "timed_out": 0}
        return counts

    def state_dict(self) -> dict:
        with self.changed:
            return self.ledger.state_dict()

    def resumed(self, step: int, version: int, state: dict | None) -> None:
        """Admission goes on from the groups trained so far, rebased on the restored version; the ledger from
        ``state`` (a checkpoint's ``state_dict``), if there is one."""
        with self.changed:
            self.admission.rebase(step, version, step * self.batch)
            if state is not None:
                self.ledger.load_state_dict(state)

    def close(self) -> None:
        """Cancel the requests in flight and stop the loop (before the rollout workers stop)."""
        self.roster.stop()
        if self.loop is None:
            return
        loop, self.loop = self.loop, None

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        self.thread.join(timeout=30)
