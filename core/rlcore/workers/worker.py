"""The trained models' workers: what every one does (``Worker``: its world, checkpoints, profiling) and the actor's
(``ActorWorker``; colocated mode's, with its engine: ``rlcore.workers.colocated``). Every method is SPMD: the driver
calls it on every worker of the group, each with its own share of the data, and collectives inside line up across
ranks."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlcore.config import Config, bind_plugin_section
from rlcore.data import Batch
from rlcore.lora.config import LoRAConfig, lora_config
from rlcore.lora.sync import AdapterSync, pushed
from rlcore.learner.actor_loss import ActorLoss
from rlcore.lr_schedule import total_updates

if TYPE_CHECKING:
    from rlcore.megatron.trainable import MegatronTrainable
    from rlcore.profiling import PhaseProfiler
    from rlcore.weight_sync.push import WeightPushSender


def _node() -> str:
    """The Ray node this worker runs on ("local" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except ImportError:
        return "local"


@dataclass(frozen=True)
class Coords:
    rank: int
    dp_rank: int
    dp_size: int
    rollout_replica: int      # which rollout engine replica (ranks of one replica share an engine TP group)
    rollout_replicas: int
    reports: bool             # this rank's results speak for its data-parallel group (tp 0, cp 0, last stage)
    leads_replica: bool       # this rank's generations speak for its rollout replica
    node: str                 # the Ray node this worker runs on
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    pid: int = field(default_factory=os.getpid)            # what the system's logs (an OOM kill) name it by
    host: str = field(default_factory=socket.gethostname)

    def describe(self) -> str:
        """Where this worker sits, for a message about it."""
        return (f"rank {self.rank} (tp {self.tp_rank}, pp {self.pp_rank}, cp {self.cp_rank}, ep {self.ep_rank}, "
                f"dp {self.dp_rank}; pid {self.pid} on {self.host})")


def join_world(rank: int, world_size: int, master: tuple[str, int] | None) -> None:
    """Point torch.distributed at this worker group's rendezvous (each group is its own world)."""
    if world_size > 1:
        assert master is not None, "a group of several ranks needs a rendezvous (host, port)"
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from rlcore import logs

    logs.configure()


def parallel_coords(rank: int, rollout_tp: int = 1, world_size: int = 1) -> Coords:
    """This rank's place in the Megatron layout (once the parallel state is initialised)."""
    from megatron.core import parallel_state as mpu

    reports = (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
               and mpu.is_pipeline_last_stage())
    return Coords(rank=rank, dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
                  rollout_replica=rank // rollout_tp, rollout_replicas=world_size // rollout_tp, reports=reports,
                  leads_replica=rank % rollout_tp == 0, node=_node(), tp_rank=mpu.get_tensor_model_parallel_rank(),
                  pp_rank=mpu.get_pipeline_model_parallel_rank(), cp_rank=mpu.get_context_parallel_rank(),
                  ep_rank=mpu.get_expert_model_parallel_rank())


class Worker:
    """What every worker does first: join its group's world, load the plugins, bind the algorithm's options. Its
    subclass sets ``trainable``, the Megatron model it trains (the actor, the critic)."""
    trainable: "MegatronTrainable"
    coords: Coords            # where this rank sits, set by the subclass once its model is built
    role = "worker"           # how messages name its group

    def __init__(self, cfg: Config, plugin_names: list[str] | None, rank: int, world_size: int,
                 master: tuple[str, int] | None):
        join_world(rank, world_size, master)
        from rlcore.plugins import load_plugins

        self.cfg = cfg
        self.registry = load_plugins(plugin_names).registry
        self.algorithm = self.registry.get("algorithms", cfg.algorithm["name"])
        self.algo_cfg = bind_plugin_section("algorithm", dict(cfg.algorithm), self.algorithm.config_cls)
        self.pending_saves = None     # asynchronous checkpoint writes (megatron-core's AsyncCallsQueue)
        self.profiler: PhaseProfiler | None = None     # a phase being profiled (trainer.profile_steps)

    def get_coords(self) -> Coords:
        return self.coords

    def stop(self) -> None:
        """Release what the worker holds (an engine, a channel) before its process exits."""

    def save_checkpoint(self, directory: str, asynchronous: bool = False) -> None:
        """Collective: the model's and optimizer's shards (``directory``/model), and per rank its update count and
        random generators (``directory``/rank<r>.json). ``asynchronous``: the shards are written while training
        goes on, complete once ``finish_checkpoint`` says so."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        from rlcore.megatron.checkpoint import rng_state, save_model, write_json

        if asynchronous and self.pending_saves is None:
            self.pending_saves = AsyncCallsQueue()
        with_optimizer = save_model(self.trainable, os.path.join(directory, "model"),
                                    self.pending_saves if asynchronous else None)
        write_json(os.path.join(directory, f"rank{torch.distributed.get_rank()}.json"),
                   {"updates": self.trainable.updates, "rng": rng_state(),
                    "with_optimizer": with_optimizer, **self.checkpoint_extras()})

    def finish_checkpoint(self, blocking: bool) -> bool:
        """Collective: finalize an asynchronous save whose writes are done on every rank (all of them: ``blocking``);
        returns whether none is left pending."""
        if self.pending_saves is None:
            return True
        self.pending_saves.maybe_finalize_async_calls(blocking=blocking)
        return self.pending_saves.get_num_unfinalized_calls() == 0

    def answer(self, method: str, reports: bool, *args):
        """``method``'s result where this rank ``reports`` for its data-parallel share, else None: its TP, CP and PP
        peers compute the same result, which need not travel back. A tensor travels in a ``Batch``, whose bytes
        go through Ray's object store without ``torch.save``'s copies (``WorkerGroup`` unwraps it)."""
        result = getattr(self, method)(*args)
        if not reports:
            return None
        return Batch({"answer": result}) if isinstance(result, torch.Tensor) else result

    def profile_begin(self, directory: str, phase: str) -> None:
        """trainer.profile_steps: profile this process until ``profile_end`` (``rlcore.profiling``)."""
        from rlcore.profiling import PhaseProfiler

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.profiler = PhaseProfiler(os.path.join(directory, f"{phase}-rank{rank}"))
        self.profiler.begin()

    def profile_end(self) -> list[str]:
        """Write the trace and memory record of the phase ``profile_begin`` started; the files written."""
        assert self.profiler is not None, "profile_end without profile_begin"
        written, self.profiler = self.profiler.end(), None
        return written

    def checkpoint_extras(self) -> dict:
        """More of this rank's state for its checkpoint file (JSON-able); ``load_checkpoint`` gets it back."""
        return {}

    def load_checkpoint(self, directory: str) -> dict:
        """Collective: what ``save_checkpoint`` wrote, at this group's layout (a rank the saved layout did not have
        takes rank 0's generators)."""
        from rlcore.megatron.checkpoint import load_model, read_json, set_rng_state

        mine = os.path.join(directory, f"rank{torch.distributed.get_rank()}.json")
        state = read_json(mine if os.path.exists(mine) else os.path.join(directory, "rank0.json"))
        load_model(self.trainable, os.path.join(directory, "model"), state["with_optimizer"])
        self.trainable.updates = state["updates"]
        set_rng_state(state["rng"])
        return state


class ActorWorker(Worker):
    """The actor's training side: the Megatron model, its updates, export; and, in async mode, the push of its
    weights to the rollout workers (``rlcore.weight_sync.push``)."""
    role = "actor"

    def __init__(self, cfg: Config, plugin_names: list[str] | None, model_path: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        super().__init__(cfg, plugin_names, rank, world_size, master)
        from rlcore.megatron.actor import MegatronActor
        from rlcore.megatron.model import read_hf_config, starting_weights

        reg = self.registry
        self.hf_config = read_hf_config(model_path)
        self.actor = MegatronActor(reg.get("models", cfg.model.family), self.hf_config, cfg.actor,
                                   reg.get("optimizers", cfg.actor.optim.name), hf_state=starting_weights(model_path),
                                   seed=cfg.run.seed, bucket_bytes=int(cfg.rollout.sync_bucket_mb * (1 << 20)),
                                   sync_transport=cfg.rollout.sync_transport,
                                   total_updates=total_updates(cfg.trainer.steps, cfg.actor))
        self.trainable = self.actor
        if self.algorithm.needs_reference(self.algo_cfg):    # the starting weights, also when a run resumes
            self.actor.freeze_reference()
        self.coords = parallel_coords(rank, cfg.rollout.tp if cfg.trainer.mode == "colocated" else 1, world_size)
        self.pusher: WeightPushSender | None = None   # async mode, global rank 0: the sending end of the weight push
        self.adapter_sync: AdapterSync | None = None  # rollout.lora=adapters: a sync sends the adapters only
        if cfg.rollout.lora == "adapters":
            self.adapter_sync = AdapterSync(self.actor.model, self.actor.converter, self._lora(), model_path,
                                            module_name=self.actor.spec.module_name)

    def train_mode(self) -> None:
        """Always in train mode: no engine shares this process (``rlcore.workers.colocated`` has one)."""

    # --- training ------------------------------------------------------------------------------------------------
    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        return self.actor.logprobs(batch, reference=reference, temperature=self.cfg.rollout.temperature)

    def live_routing(self, batch: Batch) -> torch.Tensor:
        """[rows, S, 2]: the logprobs of a pass routed live, and per token position the MoE layers whose experts
        differ from the batch's routed experts (``rlcore.learner.routing``)."""
        logprobs, differing, _ = self.actor.routing(batch, temperature=self.cfg.rollout.temperature)
        return torch.stack([logprobs, differing.float()], -1)

    def train_step(self, share: Batch, total_tokens: float, total_sequences: float, single_update: bool) -> dict:
        """One update on this rank's share of a mini-batch; the loss is normalised by the mini-batch totals."""
        loss_fn = ActorLoss(self.algorithm, self.algo_cfg, self.cfg, total_tokens, total_sequences, single_update)
        return self.actor.train_step(share, loss_fn, self.cfg.rollout.temperature, entropy=True)

    # --- async mode: the weights to the rollout workers --------------------------------------------------------
    def open_push(self, address: str, receivers: int) -> None:
        """Global rank 0 becomes the channel's sender (the rollout workers open its receiving ends at once)."""
        if self.coords.rank == 0:
            from rlcore.weight_sync.push import WeightPushSender

            if self.pusher is not None:     # the channel to the rollout workers before one died or joined
                self.pusher.close()
            self.pusher = WeightPushSender(address, receivers, int(self.cfg.rollout.sync_bucket_mb * (1 << 20)),
                                           self.cfg.rollout.sync_transport)

    def push_weights(self, version: int) -> dict[str, float]:
        """Collective: every rank streams the full HF tensors (``actor.hf_weights``), or gathers the adapters
        (``rollout.lora=adapters``); rank 0 sends them on."""
        if self.adapter_sync is not None:
            weights = pushed(self.adapter_sync.tensors(), self.adapter_sync.config)
        else:
            weights = self.actor.hf_weights()
        if self.pusher is None:
            for _ in weights:
                pass
            return {}
        try:
            stats = self.pusher.send(weights, version)
        except Exception:       # a receiver died: the other ranks' gathers of the stream still run to its end
            for _ in weights:
                pass
            raise
        return {"sync/seconds": stats.seconds, "sync/bytes": float(stats.bytes), "sync/tensors": float(stats.tensors)}

    # --- the rest --------------------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Sums of this rank's parameters, split into MoE experts, TP-sharded and replicated ones: data-parallel
        replicas holding the same shard must agree on all three, the ranks of a pipeline stage on the replicated
        ones (a missing grad all-reduce shows here)."""
        from megatron.core import parallel_state as mpu

        from rlcore.megatron.names import is_expert

        sums = {"experts": 0.0, "sharded": 0.0, "replicated": 0.0}
        for p in self.actor.model.parameters():
            key = ("experts" if is_expert(p) else "sharded" if getattr(p, "tensor_model_parallel", False)
                   else "replicated")
            sums[key] += float(p.detach().double().sum())
        return dict(tp=mpu.get_tensor_model_parallel_rank(), pp=mpu.get_pipeline_model_parallel_rank(),
                    ep=mpu.get_expert_model_parallel_rank(), **sums)

    def export_hf(self, directory: str) -> None:
        self.actor.save_hf(directory, int(self.cfg.trainer.export_max_shard_gb * 1e9))

    def export_adapter(self, directory: str, base_path: str) -> None:
        """Collective (a LoRA run): the adapters gathered as the adapters-only sync gathers them; global rank 0
        writes PEFT's adapter directory (for ``base_path``'s model)."""
        import torch.distributed as dist

        from rlcore.export import write_peft_adapter

        sync = self.adapter_sync or AdapterSync(self.actor.model, self.actor.converter, self._lora(), base_path,
                                                engine=False, module_name=self.actor.spec.module_name)
        tensors = sync.tensors()
        if dist.get_rank() == 0:
            write_peft_adapter(directory, tensors, sync.config)

    def _lora(self) -> LoRAConfig:
        """``actor.lora`` of a LoRA run (the config check refuses rollout.lora=adapters without it)."""
        lora = lora_config(self.cfg.actor.lora)
        assert lora is not None, "actor.lora.rank is 0: not a LoRA run"
        return lora

    def num_parameters(self) -> int:
        return self.actor.num_parameters()

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
