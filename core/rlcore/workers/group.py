"""The driver's handle on a group of SPMD workers: one in-process worker, or one Ray actor per process.

Its calls name a worker method by reference (``ActorWorker.export_hf``), never by a string, so that mypy checks each
call's arguments and result; the group sends each worker its share (data-parallel share of a batch, rollout-replica
share of the prompts), collects the results from the ranks that speak for each share, and turns a worker's death
into one line naming it. The typed methods the run's parts call are ``rlcore.workers.proxies``'. The driver itself
holds no weights.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
from typing import Any, Callable, Concatenate, NoReturn, ParamSpec, TypeVar

import torch

from rlcore.balance import balanced_partition
from rlcore.config import Config, reward_model_world
from rlcore.data import Batch
from rlcore.errors import PEER_DEATH_WAIT_S, WorkerDied
from rlcore.supervision import end_processes
from rlcore.launch import free_port
from rlcore.workers.worker import Worker

log = logging.getLogger(__name__)

# every Ray worker's environment: one torch thread per process (a worker is one rank), an in-process vLLM engine
WORKER_ENV = {"env_vars": {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}

P = ParamSpec("P")
R = TypeVar("R")


def dp_parts(batch: Batch, parts: int) -> list[list[int]]:
    """Each data-parallel rank's rows of ``batch``: groups of nearly equal token counts (``balanced_partition``)
    where rows know their lengths, so that no rank waits for one holding the long responses; contiguous otherwise."""
    if parts > 1 and "prompt_len" in batch.tensors:
        return balanced_partition((batch["prompt_len"] + batch["response_len"]).tolist(), parts)
    return [list(r) for r in shares(len(batch), parts)]


def in_batch_order(parts: list[list[int]], results: list[torch.Tensor]) -> torch.Tensor:
    """Per-rank per-token results [rows of the part, S] back in the rows' order in the batch."""
    out = torch.empty(sum(len(p) for p in parts), *results[0].shape[1:], dtype=results[0].dtype)
    for part, result in zip(parts, results):
        out[part] = result
    return out


def shares(n: int, parts: int) -> list[range]:
    """Contiguous, near-equal index ranges."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def death_cause(error: BaseException) -> str:
    """How a worker died, in Ray's words: its exit type, and what that means here."""
    from ray.exceptions import OutOfMemoryError

    found = re.search(r"Worker exit type: (\w+)", str(error))
    exit_type = found[1] if found else "unknown"
    if exit_type == "NODE_OUT_OF_MEMORY" or isinstance(error, OutOfMemoryError):
        return "it ran out of memory (Ray's memory monitor killed it: NODE_OUT_OF_MEMORY)"
    if exit_type == "SYSTEM_ERROR":
        return ("its process was killed (Ray: SYSTEM_ERROR, the process ended without exiting: SIGKILL, the kernel's "
                "OOM killer - see dmesg - or a crash)")
    return f"Ray says: worker exit type {exit_type}"


def start_ray(cfg: Config) -> None:
    """Join ``trainer.ray_address``'s cluster, or start an embedded one, unless Ray runs already. A SIGTERM handler
    of the run's (`rlcore run`'s: ``rlcore.supervision``) stays: ray.init replaces it with one that exits at once."""
    import ray

    if ray.is_initialized():
        return
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        _init_ray(cfg)
    finally:
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)


def _init_ray(cfg: Config) -> None:
    import ray

    if cfg.trainer.ray_address:
        ray.init(address=cfg.trainer.ray_address, log_to_driver=True)
    else:  # embedded; Ray's CPUs are scheduling slots: one per worker (actor's, critic's, rollout's), whatever the
        # core count. address="local": a Ray of its own even while another process on this host runs a cluster
        # (ray.init() would try to join the one in /tmp/ray/ray_current_cluster and fail on num_cpus)
        workers = cfg.trainer.world_size + (cfg.critic.world_size or cfg.trainer.world_size)
        workers += cfg.rollout.world_size if cfg.trainer.mode == "async" else 0
        workers += reward_model_world(cfg) if cfg.reward_model.path else 0
        start_local_ray(address="local", num_cpus=max(workers, os.cpu_count() or 1, 8), include_dashboard=False,
                        log_to_driver=True)


RAY_START_TIMEOUT = "timed out during startup"    # the end of Ray's wait for the node's raylet to register
RAY_START_TRIES = 3


def start_local_ray(**options) -> None:
    """``ray.init(**options)`` of an embedded node. Ray gives the node's raylet 30 s to register with its GCS
    (hard-coded in ray/_private/node.py); with every core busy it has needed longer (2 cores under a test suite), so
    a start that timed out so is tried again, up to RAY_START_TRIES times, once the processes it started are gone."""
    import psutil
    import ray

    for attempt in range(1, RAY_START_TRIES + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(**options)
            return
        except Exception as error:
            if RAY_START_TIMEOUT not in str(error) or attempt == RAY_START_TRIES:
                raise
        ray.shutdown()
        end_processes([p for p in psutil.Process().children(recursive=True) if p.pid not in before], within=10)


class WorkerGroup:
    """Workers of one class (``worker_cls``: the actor's, the critic's), forming their own torch.distributed world:
    in this process when there is one, else one Ray actor per process."""
    worker_cls: type[Worker] = Worker       # a proxy's own workers (``rlcore.workers.proxies``)

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str,
                 worker_cls: type | None = None, world: int | None = None):
        worker_cls = worker_cls or self.worker_cls
        self.world = world or cfg.trainer.world_size
        self.role = getattr(worker_cls, "role", worker_cls.__name__)
        self.dead = False             # a worker died: the group has stopped
        if self.world == 1:
            self.workers = [worker_cls(cfg, plugin_names, model_path)]
            self.remote = False
        else:
            self.workers = self._start_ray(cfg, plugin_names, model_path, worker_cls)
            self.remote = True
        self.coords = self.call(Worker.get_coords)
        self.dp_size = self.coords[0].dp_size
        self.replicas = self.coords[0].rollout_replicas

    def _start_ray(self, cfg: Config, plugin_names, model_path, worker_cls):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        start_ray(cfg)
        self.placement = placement_group([{"CPU": 1}] * self.world, strategy=cfg.trainer.placement.upper())
        ray.get(self.placement.ready())
        master = (ray.util.get_node_ip_address(), free_port())
        remote_cls = ray.remote(num_cpus=1)(worker_cls)
        return [remote_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i),
                                   runtime_env=WORKER_ENV).remote(cfg, plugin_names, model_path, i, self.world, master)
                for i in range(self.world)]

    # --- plumbing ------------------------------------------------------------------------------------------------
    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method`` (a worker class's, ``ActorWorker.export_hf``) on every worker with the same arguments; the
        results in rank order. Each worker runs its own class's method of that name (a subclass's override)."""
        return self.call_each(method, [args] * self.world, kwargs=kwargs)

    def call_each(self, method: Callable[..., R], per_rank: list[tuple], phase: str | None = None,
                  kwargs: dict | None = None) -> list[R]:
        """``method`` on every worker, ``per_rank[i]`` the arguments of rank i; ``phase``: what a message about a
        worker dying in it calls the call (the method's name by default)."""
        name, kwargs = method.__name__, kwargs or {}
        if not self.remote:
            return [getattr(self.workers[0], name)(*per_rank[0], **kwargs)]
        return self._results([getattr(w, name).remote(*a, **kwargs) for w, a in zip(self.workers, per_rank)],
                             phase or name)

    def _results(self, refs: list, phase: str) -> list:
        """The workers' results in rank order. A worker that died (killed, out of memory) stops the group as soon as
        Ray reports it and raises ``WorkerDied`` naming it; its peers' collectives with it fail (gloo: connection
        closed), possibly before Ray reports the death, so a worker's error first looks for a dead peer."""
        import ray
        from ray.exceptions import ActorDiedError, OutOfMemoryError, RayError

        rank = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            try:
                results[rank[ready]] = ray.get(ready)
            except (ActorDiedError, OutOfMemoryError) as e:
                self._died(rank[ready], phase, e)
            except RayError:
                done = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_WAIT_S)[0] if pending else []
                for ref in done:
                    try:
                        ray.get(ref)
                    except (ActorDiedError, OutOfMemoryError) as e:
                        self._died(rank[ref], phase, e)
                    except RayError:
                        pass
                raise
        return results

    def _died(self, rank: int, phase: str, error: Exception) -> NoReturn:
        """Stop the group (the other workers exit: their collectives with the dead one have failed) and say in one
        line which worker died, where it sat, what it was doing and how."""
        where = self.coords[rank].describe() if hasattr(self, "coords") else f"rank {rank}"
        phase = "start" if phase == Worker.get_coords.__name__ else phase
        self.dead = True
        self._exit_workers(timeout_s=10)
        raise WorkerDied(f"{self.role} worker {where} died during {phase}: {death_cause(error)}") from None

    def _by_dp(self, batch: Batch, parts: list[list[int]]) -> list[tuple]:
        """Each worker's arguments: its data-parallel share of ``batch`` (``parts``: ``dp_parts``). Ray workers get
        each share put into the object store once, as a reference its ranks (TP, CP, PP peers) all read: Ray would
        serialise an argument passed by value again for every rank."""
        shares: list = [batch.select(r) for r in parts]
        if self.remote:
            import ray

            shares = [ray.put(s) for s in shares]
        return [(shares[c.dp_rank],) for c in self.coords]

    def _reported(self, results: list) -> list:
        """One result per data-parallel rank, in dp order."""
        by_dp = {c.dp_rank: r for c, r in zip(self.coords, results) if c.reports}
        return [by_dp[i] for i in range(self.dp_size)]

    def _per_share(self, method: Callable, per_rank: list[tuple]) -> list:
        """``method`` on every rank; the results of the ranks that report, one per data-parallel share in dp order.
        Ray workers send back only those (``Worker.answer``)."""
        if not self.remote:
            return self._reported(self.call_each(method, per_rank))
        asked = [(method.__name__, c.reports, *a) for c, a in zip(self.coords, per_rank)]
        results = self.call_each(Worker.answer, asked, phase=method.__name__)
        return [r["answer"] if isinstance(r, Batch) else r for r in self._reported(results)]

    def per_token(self, method: Callable[..., torch.Tensor], batch: Batch, *args) -> torch.Tensor:
        """A forward pass that returns a per-token tensor [N, S] (``logprobs``, ``values``), split by dp rank."""
        parts = dp_parts(batch, self.dp_size)
        shares = self._by_dp(batch, parts)
        return in_batch_order(parts, self._per_share(method, [a + args for a in shares]))

    def update(self, method: Callable[..., dict[str, float]], mini: Batch, *args) -> dict[str, float]:
        """One update on a mini-batch (``method``: the workers' ``train_step``), each rank's loss normalised by the
        mini-batch's totals; the mean of the reporting ranks' metrics."""
        tokens, seqs = float(mini["response_mask"].sum()), float(len(mini))
        shares = self._by_dp(mini, dp_parts(mini, self.dp_size))
        reported = self._per_share(method, [a + (tokens, seqs, *args) for a in shares])
        return {k: sum(r[k] for r in reported) / len(reported) for k in reported[0]}

    def stop(self) -> None:
        if self.dead:                 # stopped when the worker died
            return
        try:
            self.call(Worker.stop)
        finally:
            if self.remote:
                self._exit_workers()
    def _exit_workers(self, timeout_s: float = 60) -> None:
        """Let each worker process exit normally (its exit handlers free the engine's shared-memory segments,
        which a kill would leak into /dev/shm and break the next start); kill only those that hang."""
        import ray

        exits = [w.__ray_terminate__.remote() for w in self.workers]
        _, hung = ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
        for w, ref in zip(self.workers, exits):
            if ref in hung:
                log.warning("worker did not exit within %.0f s; killing it", timeout_s)
                ray.kill(w)
        ray.util.remove_placement_group(self.placement)
