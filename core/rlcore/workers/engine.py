"""The rollout engine a worker hosts and the agent that drives it, built one way for both modes: in colocated mode
beside the actor (``rlcore.workers.colocated``), in async mode in a rollout worker of its own
(``rlcore.workers.rollout_worker``)."""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from rlcore.config import Config, bind_agent
from rlcore.converted import starts_weightless
from rlcore.specs import Agent, RolloutBackend


def engine_options(cfg: Config) -> dict:
    """The rollout backend factory's optional keywords, passed only when a run needs them: ``lora_rank`` with
    ``rollout.lora=adapters`` (the engine serves adapters of ``actor.lora.rank`` on its base weights:
    ``RolloutBackendSpec.lora_adapters``), ``routed_experts`` with ``actor.moe.routing_replay=rollout``."""
    options: dict = {"lora_rank": cfg.actor.lora.rank} if cfg.rollout.lora == "adapters" else {}
    if cfg.actor.moe.routing_replay == "rollout":
        options["routed_experts"] = True
    return options


@dataclass
class HostedEngine:
    backend: RolloutBackend
    agent: Agent
    weightless: bool          # started without weights: the first push gives it the actor's
    directory: str | None     # the weightless copy of the model's files it started from

    def close(self) -> None:
        self.backend.stop()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def build_engine(cfg: Config, registry, model_path: str, hf_config: dict, distributed: bool) -> HostedEngine:
    """``rollout.backend``'s engine on ``model_path`` (or, where it cannot start from those files, on a weightless
    copy of them), then the run's agent; ``distributed``: the engine shards over this worker group's ranks."""
    from rlcore.hf_checkpoint import weightless_copy

    weightless = starts_weightless(model_path, hf_config)
    directory = tempfile.mkdtemp(prefix="rlcore-engine-") if weightless else None
    backend = registry.get("rollout_backends", cfg.rollout.backend).factory(
        weightless_copy(model_path, directory) if directory else model_path, cfg.rollout, seed=cfg.run.seed,
        max_model_len=hf_config["max_position_embeddings"], distributed=distributed,
        **({"load_weights": False} if weightless else {}), **engine_options(cfg))
    spec = registry.get("agents", cfg.rollout.agent)
    agent = spec.make(model_path, cfg, registry, bind_agent(spec, cfg.agent))
    return HostedEngine(backend, agent, weightless, directory)
