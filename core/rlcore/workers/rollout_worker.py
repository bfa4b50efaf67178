"""Async mode's rollout workers: processes of their own (Ray actors in a placement group apart from the trainer's),
each hosting one engine replica behind a ``PausableEngine``, running the run's agent on the prompts the driver's
producer sends, and taking weight pushes from the trainer while other requests are in flight.

A worker is an asyncio Ray actor: every call runs on one event loop, where the engine steps between requests, so
groups stream back as they finish (a Ray streaming generator) and a push (pause, load, resume) interleaves with them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from rlcore.config import Config
from rlcore.specs import Sampling
from rlcore.trajectory import Trajectory, episode_samples
from rlcore.weight_sync.logprob_check import Probe, score
from rlcore.workers.group import WORKER_ENV, death_cause, start_ray

if TYPE_CHECKING:
    from rlcore.weight_sync.push import WeightPushReceiver
    from rlcore.workers.engine import HostedEngine


class RolloutWorker:
    role = "rollout"

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, index: int):
        from rlcore.workers.worker import join_world

        join_world(0, 1, None)
        self.cfg, self.plugin_names, self.model_path, self.index = cfg, plugin_names, model_path, index
        self.receiver: WeightPushReceiver | None = None
        self.hosted: HostedEngine | None = None      # the engine and agent, built by start()
        self.pid = os.getpid()

    async def start(self) -> dict:
        """Build the engine on the actor's event loop (an engine may bind to the loop it is built on); where this
        worker runs, and the processes its engine started (an engine at rollout.tp > 1 runs its ranks there)."""
        import socket

        import psutil

        from rlcore.megatron.model import read_hf_config
        from rlcore.plugins import load_plugins
        from rlcore.rollout.pausable import PausableEngine
        from rlcore.workers.engine import build_engine

        registry = load_plugins(self.plugin_names).registry
        self.hosted = hosted = build_engine(self.cfg, registry, self.model_path, read_hf_config(self.model_path),
                                            distributed=False)
        self.engine = PausableEngine(hosted.backend, partial=self.cfg.rollout.partial)
        self.agent = hosted.agent
        self.stats_read = time.perf_counter()
        started = []
        for child in psutil.Process().children(recursive=True):
            try:
                started.append(child.cmdline()[0])
            except (psutil.Error, IndexError):      # gone already, or a zombie
                pass
        return {"index": self.index, "pid": self.pid, "host": socket.gethostname(), "weightless": hosted.weightless,
                "engine_processes": started}

    async def _indexed(self, i: int, *args) -> tuple[int, list[Trajectory] | None]:
        try:
            return i, await asyncio.wait_for(self._group(*args), self.cfg.rollout.request_timeout or None)
        except asyncio.TimeoutError:    # its requests were aborted (a cancelled caller aborts its request)
            return i, None

    async def _group(self, prompt: list[int], metadata: dict, n: int, sampling: Sampling, seed: int | None,
                     tag: str) -> list[Trajectory]:
        results = await asyncio.gather(*(self.agent.run(prompt, metadata, self.engine, sampling,
                                                        None if seed is None else seed + j, f"{tag}-{j}")
                                         for j in range(n)))
        return [t for result in results for t in episode_samples(result)]

    async def stream_groups(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                            seeds: list[int], tag: str) -> AsyncIterator[tuple[int, list[Trajectory] | None]]:
        """``n`` episodes of each prompt, all requests issued at once (the engine batches them as the colocated
        worker's ``episodes`` does: sample j of prompt i seeded ``seeds[i] + j``); yields (i, group) as each group
        completes, (i, None) for a group still running ``rollout.request_timeout`` seconds after it started."""
        tasks = [asyncio.ensure_future(self._indexed(i, p, m, n, sampling, s, f"{tag}-{i}"))
                 for i, (p, m, s) in enumerate(zip(prompts, metadata, seeds))]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for task in tasks:
                task.cancel()

    async def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                       seeds: list[int], tag: str = "episode") -> list[list[Trajectory]]:
        """All groups at once, in prompt order (evaluation)."""
        return list(await asyncio.gather(*(self._group(p, m, n, sampling, s, f"{tag}-{i}")
                                           for i, (p, m, s) in enumerate(zip(prompts, metadata, seeds)))))

    # --- weights -------------------------------------------------------------------------------------------------
    async def open_push(self, address: str, rank: int, receivers: int) -> None:
        """The receiving end of the trainer's weight push (the trainer's rank 0 opens the sending end at once)."""
        from rlcore.weight_sync.push import WeightPushReceiver

        cfg = self.cfg.rollout
        if self.receiver is not None:       # the channel of the workers before one died or joined
            self.receiver.close()
        self.receiver = WeightPushReceiver(address, rank, receivers, int(cfg.sync_bucket_mb * (1 << 20)),
                                           cfg.sync_transport)     # connects at the first receive

    async def receive_weights(self, probe: Probe | None = None) -> dict:
        """Pause the engine (``rollout.partial``: abort what is in flight, to resume it after; else let it finish),
        load the pushed weights, score ``probe`` (sequences, start, images) with them if given, resume. A push that
        fails halfway leaves the engine paused (its weights are half old, half new) until one succeeds."""
        receiver = self.receiver
        assert receiver is not None, "open_push first"
        paused = time.perf_counter()
        await self.engine.pause()
        drained = time.perf_counter() - paused
        # off the actor's loop, which an engine's blocking calls may need running (SGLang's do)
        version, scores = await asyncio.to_thread(self._load, receiver, probe)
        self.engine.resume()
        return {"version": version, "scores": scores, "drain_seconds": drained,
                "pause_seconds": time.perf_counter() - paused}

    def _load(self, receiver: WeightPushReceiver, probe: Probe | None) -> tuple[int, list[list[float]] | None]:
        try:
            version, stream = receiver.receive()
            if self.cfg.rollout.lora == "adapters":
                from rlcore.lora.sync import received

                self.engine.load_adapters(*received(stream), version)
            else:
                self.engine.update_weights(stream, version)
        except BaseException:   # a push given up halfway: closing the channel tells the sender at once, where it
            receiver.close()        # would otherwise wait out its timeout for the rest of the collectives
            if self.receiver is receiver:
                self.receiver = None
            raise
        return version, score(self.engine, *probe) if probe is not None else None

    async def stats(self) -> dict:
        """The engine's counters since the last call (idle time, resumed requests) and the seconds they span."""
        now = time.perf_counter()
        interval, self.stats_read = now - self.stats_read, now
        return {**dataclasses.asdict(self.engine.stats()), "interval_s": interval}

    async def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        hosted, self.hosted = self.hosted, None
        if hosted is not None:        # the engine (behind its PausableEngine), then its weightless files
            hosted.close()


class RolloutWorkers:
    """The driver's handle on the rollout workers: one Ray actor per engine replica (``rollout.world_size /
    rollout.tp``) in a slot of its own, each holding ``rollout.tp`` slots of a placement group of their own for its
    engine's tensor-parallel processes (which the engine starts itself: SGLang's schedulers); started and ready (engines
    built) on return. Its calls return Ray's references at once, one per worker named (the queued source waits on them
    when it needs them: ``rlcore.rollout.handles.EngineWorkers``). A dead slot's worker is replaced in the same
    placement-group bundle (``replace``)."""

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str):
        import ray
        from ray.util.placement_group import placement_group

        start_ray(cfg)
        self.cfg, self.plugin_names, self.model_path = cfg, plugin_names, model_path
        tp = cfg.rollout.tp
        self.world = cfg.rollout.world_size // tp
        self.placement = placement_group([{"CPU": tp}] * self.world, strategy=cfg.trainer.placement.upper())
        ray.get(self.placement.ready())
        self.added: dict[int, Any] = {}      # slots added to a running job (rlcore scale): their placement groups
        self.workers: list[Any] = [self._actor(i) for i in range(self.world)]
        self.where: list[dict] = ray.get([w.start.remote() for w in self.workers])

    def _actor(self, index: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement, bundle = (self.added[index], 0) if index in self.added else (self.placement, index)
        remote_cls = ray.remote(num_cpus=self.cfg.rollout.tp)(RolloutWorker)
        return remote_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(placement, bundle),
                                  runtime_env=WORKER_ENV).remote(self.cfg, self.plugin_names, self.model_path, index)

    def start_worker(self, index: int, started: Callable[[dict | None, BaseException | None], None]) -> None:
        """A new worker in slot ``index``: in place of a dead one (ended, in case it only seems so), in its bundle of
        the placement group; or in a new slot (``index`` = the number of slots), in a placement group of its own.
        ``started(where, error)`` is called once its engine is built (where it runs), or its start failed, from a
        thread of its own (never from Ray's: a Ray call in a Ray callback deadlocks the driver)."""
        import ray
        from ray.util.placement_group import placement_group

        if index < len(self.workers):
            ray.kill(self.workers[index])
        else:
            self.added[index] = placement_group([{"CPU": self.cfg.rollout.tp}])
            self.workers.append(None)
            self.where.append(dict(self.where[0]))
        self.where[index] = {**self.where[index], "pid": None}      # known once it has started
        self.workers[index] = self._actor(index)
        ref = self.workers[index].start.remote()

        def wait() -> None:
            try:
                where = ray.get(ref)
            except Exception as e:
                started(None, e)
            else:
                self.where[index] = where
                started(where, None)

        threading.Thread(target=wait, name=f"rlcore-start-rollout-{index}", daemon=True).start()

    def stop_worker(self, index: int) -> None:
        """Retire slot ``index``'s worker: its engine stopped (freeing its shared memory), then its process ended,
        on a thread of its own."""
        import ray

        worker = self.workers[index]

        def stop() -> None:
            ray.wait([worker.stop.remote()], timeout=60)
            ray.kill(worker)

        threading.Thread(target=stop, name=f"rlcore-stop-rollout-{index}", daemon=True).start()

    def _each(self, method: Callable[..., Any], members: list[int], per_worker: list[tuple]) -> list:
        return [getattr(self.workers[i], method.__name__).remote(*a) for i, a in zip(members, per_worker)]

    def open_push(self, address: str, members: list[int]) -> list:
        """Every member opens its receiving end of the push channel at ``address`` (the trainer's rank 0 is rank 0)."""
        return self._each(RolloutWorker.open_push, members, [(address, r + 1, len(members))
                                                             for r in range(len(members))])

    def receive_weights(self, probe: Probe | None, members: list[int]) -> list:
        return self._each(RolloutWorker.receive_weights, members, [(probe,)] * len(members))

    def stats(self, members: list[int]) -> list:
        return self._each(RolloutWorker.stats, members, [()] * len(members))

    def episodes(self, worker: int, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int], tag: str) -> Any:
        """Worker ``worker``'s groups of ``prompts``, all at once, in their order (evaluation)."""
        return self.workers[worker].episodes.remote(prompts, metadata, n, sampling, seeds, tag)

    def stream_groups(self, worker: int, prompts: list[list[int]], metadata: list[dict], n: int,
                      sampling: Sampling, seeds: list[int], tag: str) -> Any:
        """Worker ``worker``'s groups as each completes (``RolloutWorker.stream_groups``): Ray's streaming
        generator, whose items are references to (index, group) pairs."""
        method = getattr(self.workers[worker], RolloutWorker.stream_groups.__name__)
        return method.options(num_returns="streaming").remote(prompts, metadata, n, sampling, seeds, tag)

    def is_death(self, error: BaseException) -> bool:
        """Whether ``error`` says the worker is gone (killed, out of memory, its node lost), not that it failed."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, OutOfMemoryError

        return isinstance(error, (ActorDiedError, ActorUnavailableError, OutOfMemoryError))

    def failed(self, index: int, error: BaseException) -> str:
        """One line on rollout worker ``index``'s failure: where it ran and how it died, or its error."""
        where = self.where[index]
        what = (f"died: {death_cause(error)}" if self.is_death(error)
                else f"failed: {str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__}")
        process = "a replacement starting" if where["pid"] is None else f"pid {where['pid']}"
        return f"rollout worker {index} ({process} on {where['host']}) {what}"

    def stop(self) -> None:
        """Let each worker stop its engine (its exit frees the engine's shared memory), then end the processes. A
        worker that died or hangs is only ended: its failure was reported where it was seen."""
        import ray

        stops = [w.stop.remote() for w in self.workers]
        ray.wait(stops, num_returns=len(stops), timeout=60)
        for w in self.workers:
            ray.kill(w)
        for placement in (self.placement, *self.added.values()):
            ray.util.remove_placement_group(placement)
