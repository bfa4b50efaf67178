"""The reward model's workers: a Megatron sequence classifier (``rlcore.megatron.reward_model``) in processes of its
own, with its own layout, scoring the episodes the rollout side hands it; asleep between its passes as
``reward_model.offload`` says. Every method is SPMD over its ranks."""
from __future__ import annotations

import torch

from rlcore.config import Config
from rlcore.data import Batch
from rlcore.megatron.host_memory import offloaded_parts
from rlcore.workers.offloading import OffloadingWorker
from rlcore.workers.worker import parallel_coords


class RewardModelWorker(OffloadingWorker):
    role = "reward_model"
    trains = False        # scoring only: no gradient buffers, no optimizer state

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        super().__init__(cfg, plugin_names, rank, world_size, master)
        from rlcore.lr_schedule import total_updates
        from rlcore.megatron.model import read_hf_config, starting_weights
        from rlcore.megatron.reward_model import MegatronRewardModel, family_of

        section = cfg.reward_model
        self.hf_config = read_hf_config(model_path)
        optimizer = self.registry.get("optimizers", section.optim.name) if self.trains else None
        self.model = MegatronRewardModel(family_of(self.registry.models, self.hf_config), self.hf_config, section,
                                         optimizer, hf_state=starting_weights(model_path), seed=cfg.run.seed,
                                         total_updates=total_updates(cfg.trainer.steps, section))
        self.trainable = self.model
        self.offloaded = offloaded_parts(section.offload)
        self.coords = parallel_coords(rank)

    def token_scores(self, share: Batch) -> torch.Tensor:
        """The score head at every position of this rank's share [rows, S] (``rlcore.megatron.reward_model``)."""
        return self.model.per_token_scores(share)


class RewardModelTrainer(RewardModelWorker):
    """``rlcore train-rm``'s workers: the reward model with its optimizer, trained on preference pairs."""
    trains = True

    def train_step(self, share: Batch, total_tokens: float, total_sequences: float) -> dict:
        """One Bradley-Terry update on this rank's share of a mini-batch of pairs (two rows each)."""
        return self.model.train_pairs(share, total_sequences / 2)

    def export_hf(self, directory: str, pad_token_id: int | None) -> None:
        self.model.save_hf(directory, pad_token_id, int(self.cfg.trainer.export_max_shard_gb * 1e9))
