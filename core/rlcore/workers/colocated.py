"""Colocated mode's worker: the actor and a rollout engine shard in one process on the same device, handing it over
in turn (``HybridEngine``)."""
from __future__ import annotations

from rlcore.config import Config
from rlcore.rollout.requests import episodes
from rlcore.specs import Sampling
from rlcore.trajectory import Trajectory
from rlcore.weight_sync.hybrid import HybridEngine, SyncStats
from rlcore.weight_sync.logprob_check import LogprobComparison, compare_logprobs
from rlcore.workers.engine import HostedEngine, build_engine
from rlcore.workers.worker import ActorWorker


class ActorRolloutWorker(ActorWorker):
    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        super().__init__(cfg, plugin_names, model_path, rank, world_size, master)
        self.hosted: HostedEngine | None = build_engine(cfg, self.registry, model_path, self.hf_config,
                                                        distributed=world_size > 1)
        self.rollout, self.agent = self.hosted.backend, self.hosted.agent
        self.engine = HybridEngine(self.actor, self.rollout, in_sync=not self.hosted.weightless,
                                   offload=cfg.actor.offload, adapters=self.adapter_sync)

    # --- rollout -------------------------------------------------------------------------------------------------
    def rollout_mode(self) -> SyncStats | None:
        return self.engine.rollout_mode()

    def train_mode(self) -> None:
        self.engine.train_mode()

    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int] | None = None) -> list[list[Trajectory]]:
        return episodes(self.agent, self.rollout, prompts, metadata, n, sampling, seeds)

    def compare_logprobs(self, prompts, responses, pad_id: int, images=None) -> LogprobComparison:
        with self.engine.actor_params_on_device():
            return compare_logprobs(self.actor, self.rollout, prompts, responses, pad_id, images)

    # --- checkpoints -------------------------------------------------------------------------------------------------
    def checkpoint_extras(self) -> dict:
        return {"engine_in_sync": self.engine.synced_version == self.engine.version}

    def load_checkpoint(self, directory: str) -> dict:
        state = super().load_checkpoint(directory)       # the actor's update count (the engine's version) with it
        self.engine.synced_version = -1     # the engine still holds the starting weights: push them
        if state.get("engine_in_sync"):     # now, where the saved run had pushed them already (an evaluation
            self.engine.rollout_mode()      # after the update), so that the next step's sync is the same
            self.engine.train_mode()
        return state

    def stop(self) -> None:
        super().stop()
        if self.hosted is not None:
            self.hosted.close()
            self.hosted = None
