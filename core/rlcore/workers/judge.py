"""A generative judge's engines (``rlcore.rollout.judge``): processes of their own (Ray actors), each hosting one
engine of the judge's backend on reward_model.path, with the weights it started with (no weight push ever reaches
it). Each is an asyncio actor, as async mode's rollout workers are: a call's requests all go to the engine at once
through the per-request contract (``RolloutBackend.generate``) and its scheduler batches them. They start in
``Run.setup()`` and stop in ``Run.close()``, as the reward model's workers do, in both modes."""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from rlcore.config import Config
from rlcore.specs import Completion, Sampling
from rlcore.workers.group import WORKER_ENV, death_cause, shares, start_ray

if TYPE_CHECKING:
    from rlcore.specs import RolloutBackend


class JudgeWorker:
    role = "judge"

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, index: int):
        from rlcore.workers.worker import join_world

        join_world(0, 1, None)
        self.cfg, self.plugin_names, self.model_path, self.index = cfg, plugin_names, model_path, index
        self.engine: RolloutBackend | None = None
        self.calls = 0

    async def start(self) -> dict:
        """Build the engine on the actor's event loop (an engine may bind to the loop it is built on); where it
        runs."""
        import socket

        from rlcore.megatron.model import read_hf_config
        from rlcore.plugins import load_plugins
        from rlcore.rollout.judge import judge_rollout_config

        rollout = judge_rollout_config(self.cfg)
        spec = load_plugins(self.plugin_names).registry.get("rollout_backends", rollout.backend)
        hf_config = read_hf_config(self.model_path)
        self.engine = spec.factory(self.model_path, rollout, seed=self.cfg.run.seed,
                                   max_model_len=hf_config["max_position_embeddings"], distributed=False)
        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname(), "backend": rollout.backend}

    async def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]) -> list[Completion]:
        """One completion per prompt, in order, all requested at once."""
        assert self.engine is not None, "start first"
        engine, self.calls = self.engine, self.calls + 1
        return list(await asyncio.gather(*(engine.generate(p, sampling, s, f"judge{self.calls}-{i}")
                                           for i, (p, s) in enumerate(zip(prompts, seeds)))))

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()


class JudgeWorkers:
    """The driver's handle on the judge's engines: ``reward_model.world_size`` Ray actors (0: one), started and
    ready (engines built) on return; a call's prompts split over them in order (``rlcore.rollout.judge.JudgeEngines``).
    """

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str):
        import ray

        from rlcore.rollout.judge import judge_engines

        start_ray(cfg)
        self.world = judge_engines(cfg)
        remote_cls = ray.remote(num_cpus=1)(JudgeWorker)
        self.workers: list[Any] = [remote_cls.options(runtime_env=WORKER_ENV).remote(cfg, plugin_names, model_path, i)
                                   for i in range(self.world)]
        self.where: list[dict] = [{"index": i, "pid": "?", "host": "?"} for i in range(self.world)]
        self.where = self._get([(i, w.start.remote()) for i, w in enumerate(self.workers)], "starting")

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]) -> list[Completion]:
        refs = [(w, self.workers[w].generate.remote([prompts[i] for i in part], sampling, [seeds[i] for i in part]))
                for w, part in enumerate(shares(len(prompts), self.world)) if len(part)]
        return [c for result in self._get(refs, "judging") for c in result]

    def _get(self, refs: list[tuple[int, Any]], doing: str) -> list:
        """Each (worker, reference)'s result in order, or one line (``JudgeDied``: fatal) naming the judge's engine
        that failed and how."""
        import ray
        from ray.exceptions import ActorDiedError, OutOfMemoryError, RayError

        from rlcore.rollout.judge import JudgeDied

        results = []
        for index, ref in refs:
            try:
                results.append(ray.get(ref))
            except RayError as error:
                where = self.where[index]
                said = str(error).strip()
                what = (f"died: {death_cause(error)}" if isinstance(error, (ActorDiedError, OutOfMemoryError)) else
                        f"failed: {said.splitlines()[-1] if said else type(error).__name__}")
                raise JudgeDied(f"the judge's engine {index} (reward_model.path, pid {where['pid']} on "
                                f"{where['host']}) {what}, {doing}") from error
        return results

    def stop(self) -> None:
        """Let each engine stop (its exit frees the engine's shared memory), then end the processes."""
        import ray

        stops = [w.stop.remote() for w in self.workers]
        ray.wait(stops, num_returns=len(stops), timeout=60)
        for w in self.workers:
            ray.kill(w)
