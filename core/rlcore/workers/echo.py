"""A worker without a model, so that ``WorkerGroup``'s dispatch can be measured (``bench/dispatch.py``) and tested
in seconds through the real group code: Ray actors, data-parallel shares, reporting ranks."""
from __future__ import annotations

import torch

from rlcore.config import Config
from rlcore.data import Batch
from rlcore.workers.worker import Coords, Worker


class EchoWorker(Worker):
    """``actor.parallel.tp`` consecutive ranks share one data-parallel share, the first of them reports (as a
    Megatron layout's TP peers do). Its passes are cheap functions of the share, the same on every rank."""

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        torch.set_num_threads(1)      # no torch.distributed world, no plugins: nothing of Worker's is needed
        peers = cfg.actor.parallel.tp
        self.coords = Coords(rank=rank, dp_rank=rank // peers, dp_size=world_size // peers, rollout_replica=rank,
                             rollout_replicas=world_size, reports=rank % peers == 0, leads_replica=True, node="local")

    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """A fresh per-token tensor [rows, S], as a forward pass returns."""
        return batch["old_logprobs"] * batch["response_mask"]

    def train_step(self, share: Batch, total_tokens: float, total_sequences: float, *args) -> dict[str, float]:
        return {"tokens": float(share["response_mask"].sum()), "rows": float(len(share))}
