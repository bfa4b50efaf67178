"""The critic worker: a Megatron value model in its own processes, with its own parallel layout, optimizer and
offload switches. Every method is SPMD over the critic's ranks, like the actor worker's."""
from __future__ import annotations

import torch

from rlcore.config import Config
from rlcore.data import Batch
from rlcore.losses import aggregate
from rlcore.lr_schedule import total_updates
from rlcore.megatron.host_memory import offloaded_parts
from rlcore.workers.offloading import OffloadingWorker
from rlcore.workers.worker import parallel_coords


class CriticWorker(OffloadingWorker):
    role = "critic"

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        super().__init__(cfg, plugin_names, rank, world_size, master)
        from rlcore.megatron.critic import MegatronCritic
        from rlcore.megatron.model import read_hf_config, starting_weights

        reg = self.registry
        path = cfg.critic.model_path or model_path
        self.critic = MegatronCritic(reg.get("models", cfg.model.family), read_hf_config(path), cfg.critic,
                                     reg.get("optimizers", cfg.critic.optim.name), hf_state=starting_weights(path),
                                     seed=cfg.run.seed, total_updates=total_updates(cfg.trainer.steps, cfg.critic))
        self.trainable = self.critic
        self.offloaded = offloaded_parts(cfg.critic.offload)
        self.coords = parallel_coords(rank)

    def values(self, share: Batch) -> torch.Tensor:
        return self.critic.values(share)

    def train_step(self, share: Batch, total_tokens: float, total_sequences: float) -> dict:
        """One update of the value model on this rank's share of a mini-batch, toward ``returns``."""
        mode = self.algorithm.loss_agg_mode(self.algo_cfg)

        def loss_fn(values, mb):
            mask = mb["response_mask"]
            per_token, m = self.algorithm.value_loss(values, mb["values"], mb["returns"], mask, self.algo_cfg)
            return aggregate(per_token, mask, mode, total_tokens, total_sequences,
                             self.cfg.rollout.max_response_len), m

        return self.critic.train_step(share, loss_fn)

    def stop(self) -> None:
        pass
