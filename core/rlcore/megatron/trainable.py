"""The part of a Megatron model that trains: parallel state, Megatron DDP and optimizer, memory offload, and the
forward/backward passes over micro-batches. The actor (logprobs) and the critic (values) differ only in what they
read off the model's output per token (``token_outputs``).

Every pass runs through Megatron's ``forward_backward_func`` over micro-batches, so the same code serves every
pipeline schedule: ``micro_batch_size`` rows each, or, with ``max_tokens_per_micro_batch``, rows of similar length
packed up to that many (padded) tokens, each micro-batch only as wide as its longest row, and as many on every
data-parallel rank; with ``pack_sequences`` too, each micro-batch's sequences run end to end in one row, without
padding (``rlcore.megatron.packing``). Each rank is given its data-parallel share.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from rlcore.balance import split_to_count, token_budget_micro_batches
from rlcore.config.schema import TrainedModelConfig
from rlcore.data import Batch, sequence_lengths
from rlcore.converted import ConvertedWeights
from rlcore.lr_schedule import learning_rate
from rlcore.megatron.host_memory import to_device, to_host
from rlcore.megatron.packing import pack, unpack
from rlcore.megatron.parallel import init_parallel
from rlcore.megatron.routing_replay import RoutingRecorder, Routes, picked, router_tokens
from rlcore.model_parts import freeze
from rlcore.multimodal import IMAGE_INPUTS
from rlcore.routed_experts import ROUTED_EXPERTS
from rlcore.specs import ModelSpec, OptimizerSpec

if TYPE_CHECKING:
    from rlcore.lora.config import LoRAConfig

# loss_fn(per-token output [b, S] with grad, micro-batch, **extras) -> (scalar loss share of the mini-batch,
# metrics of this micro-batch); the actor's output is logp (extras: entropy), the critic's the values
LossFn = Callable[..., tuple[torch.Tensor, dict]]


def _pad_rows(batch: Batch, multiple: int) -> Batch:
    """Pipeline schedules need equal micro-batches: repeat the last row with an all-zero mask (it adds nothing)."""
    extra = -len(batch) % multiple
    if extra == 0:
        return batch
    idx = list(range(len(batch))) + [len(batch) - 1] * extra
    padded = batch.select(idx)
    padded.tensors["response_mask"][len(batch):] = 0
    return padded


def _pad_columns(batch: Batch, multiple: int) -> Batch:
    """Context / sequence parallelism split sequences into equal chunks: pad every per-token tensor with zeros."""
    length = batch["input_ids"].shape[1]
    extra = -length % multiple
    if extra == 0:
        return batch
    tensors = {k: torch.nn.functional.pad(v, (0, extra)) if v.dim() == 2 and v.shape[1] == length else v
               for k, v in batch.tensors.items()}
    return Batch(tensors, batch.meta)


def _select_columns(batch: Batch, index: torch.Tensor) -> Batch:
    length = batch["input_ids"].shape[1]
    return Batch({k: v[:, index] if v.dim() == 2 and v.shape[1] == length else v for k, v in batch.tensors.items()},
                 batch.meta)


def _padding_fraction(batch: Batch, computed: int, rows: list[list[int]]) -> float:
    """The share of the ``computed`` positions of the micro-batches that hold no token of a row (filler rows
    included)."""
    lengths = sequence_lengths(batch).tolist()
    return 1.0 - sum(lengths[i] for part in rows for i in part) / computed


class MegatronTrainable:
    """Subclasses build the model (``build``) and say what a pass yields per token (``token_outputs``)."""
    role = "model"   # prefixes the update's metrics (grad_norm, update_skipped)

    def __init__(self, spec: ModelSpec, hf_config: dict, cfg: TrainedModelConfig, optimizer: OptimizerSpec | None,
                 hf_state: Mapping[str, torch.Tensor] | ConvertedWeights | None = None, seed: int = 0,
                 total_updates: int = 0):
        """``total_updates``: optimizer updates in the run, where a decaying LR schedule ends. No ``optimizer``:
        the model only runs forward passes (a reward model scoring), with no gradient buffers or optimizer state."""
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed, cfg.parallel.ep, cfg.parallel.cp)
        self.spec, self.hf_config, self.cfg = spec, hf_config, cfg
        self.model, self.converter = self.build(hf_state)
        lora = self.lora_config(seed)
        if lora is not None:   # before DDP and the optimizer, which then hold buffers and state for adapters only
            from rlcore.lora.layers import add_lora

            add_lora(self.model, lora)
        freeze(self.model, self.frozen_parts(), spec.vision)     # before DDP and the optimizer too
        if optimizer is None:
            self.model.requires_grad_(False)
            self.ddp, self.optimizer = self.model, None
        else:
            self.ddp = DistributedDataParallel(self.model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=True, grad_reduce_in_fp32=True), self.model)
            # after backward: reduce grads over data-parallel ranks and all-reduce the grads of parameters that TP
            # ranks replicate but see different parts of the input for (qk-layernorm, sequence-parallel norms)
            self.model.config.finalize_model_grads_func = finalize_model_grads
            self.model.config.no_sync_func = self.ddp.no_sync
            self.optimizer = optimizer.build([self.ddp], cfg.optim)
        self.updates, self.total_updates = 0, total_updates
        self._offloaded: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.is_last_stage = mpu.is_pipeline_last_stage()
        self.cp_group, self.cp_size = mpu.get_context_parallel_group(), mpu.get_context_parallel_world_size()
        # sequences are split into 2*cp chunks (CP) and each chunk over TP ranks (SP): pad to a multiple of both
        self.sequence_multiple = (2 * self.cp_size if self.cp_size > 1 else 1) * (cfg.parallel.tp if cfg.parallel.sp
                                                                                   else 1)
        if cfg.max_tokens_per_micro_batch:      # pipeline stages then exchange each micro-batch's shape
            self.model.config.variable_seq_lengths = True

    def structure(self):
        """This rank's GPTModel, its weights not loaded yet, and the converter bound to it."""
        from rlcore.megatron.model import build_gpt

        return build_gpt(self.spec, self.hf_config, self.cfg.dtype, self.cfg.parallel.sp,
                         self.cfg.parallel.last_stage_layers, self.cfg.recompute,
                         routing_replay=self.replays_routes())

    def frozen_parts(self) -> tuple[str, ...]:
        """Parts of the model trained on as loaded, without gradients (``rlcore.model_parts``); none by default."""
        return ()

    def replays_routes(self) -> bool:
        """The MoE layers replay the batch's routed experts (``rlcore.megatron.routing_replay``)."""
        return False

    def build(self, hf_state: Mapping[str, torch.Tensor] | ConvertedWeights | None):
        """This rank's GPTModel (weights from ``hf_state`` if given: HF tensors, or a converted checkpoint's
        Megatron weights) and the converter bound to it."""
        from rlcore.megatron.checkpoint import load_weights
        from rlcore.megatron.model import load_hf_into

        model, converter = self.structure()
        if isinstance(hf_state, ConvertedWeights):
            load_weights(model, hf_state.directory)
        elif hf_state is not None:
            load_hf_into(model, converter, hf_state)
        return model, converter

    def lora_config(self, seed: int) -> LoRAConfig | None:
        """The adapters to train instead of the whole model (``rlcore.lora.layers``); None: full fine-tuning."""
        return None

    def token_outputs(self, output: torch.Tensor, labels: torch.Tensor, extras: bool) -> tuple[torch.Tensor, dict]:
        """The model's output [b, S, ...] -> the per-token tensor [b, S] a pass returns, and (when ``extras``)
        further per-token tensors handed to the loss function by keyword."""
        raise NotImplementedError

    # --- memory hand-off ---------------------------------------------------------------------------------------
    def _memory(self, what: str) -> list[torch.Tensor]:
        """The tensors behind ``params`` / ``grads`` (Megatron DDP's contiguous buffers; params also the frozen
        parameters, which have none) or ``optimizer`` (its
        state tensors and fp32 main params, one per storage, on the device only: not those sharing storage with the
        buffers, such as an fp32 model's main params, nor the hybrid optimizer's host state)."""
        buffers = [] if self.optimizer is None else list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers)
        if what == "params":   # and the frozen ones DDP keeps no buffer for (LoRA's base weights)
            frozen = [p for p in self.model.parameters() if not p.requires_grad]
            return [b.param_data for b in buffers if b.param_data is not None] + frozen
        if what == "grads":
            return [b.grad_data for b in buffers]
        if what == "optimizer":
            if self.optimizer is None:
                return []
            owned = {t.untyped_storage().data_ptr() for t in self._memory("params") + self._memory("grads")}
            inner = [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
            tensors = [t for o in inner for state in o.state.values() for t in state.values()]
            tensors += [p for o in inner for group in o.param_groups for p in group["params"]]
            unique = {t.untyped_storage().data_ptr(): t for t in tensors if torch.is_tensor(t) and t.dim() > 0
                      and t.device == buffers[0].grad_data.device}
            return [t for ptr, t in unique.items() if ptr not in owned]
        raise ValueError(f"cannot offload {what!r}: use params, grads or optimizer")

    def offload(self, what: str) -> int:
        """Move ``what`` to host memory (``to_host``). Returns the bytes moved."""
        self._offloaded[what] = to_host(self._memory(what))
        return sum(h.numel() * h.element_size() for _, h in self._offloaded[what])

    def onload(self, what: str) -> None:
        to_device(self._offloaded.pop(what, []))

    # --- passes ------------------------------------------------------------------------------------------------
    def _run(self, model, batch: Batch, loss_fn: LossFn | None, forward_only: bool, extras: bool = False,
             hook=None, recorder: RoutingRecorder | None = None, replay: bool = True
             ) -> tuple[list[dict], list, float]:
        """The pipeline schedule over ``batch``'s micro-batches: the schedule's per-micro-batch results, each
        micro-batch's rows with its per-token output (``loss_fn`` None), and the share of the positions computed
        that were padding. With ``replay``, a model that replays routes (``replays_routes``) sends the batch's
        tokens to their routed experts; a ``recorder`` reads the routing its MoE layers used."""
        from contextlib import nullcontext

        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro, rows = self._micro_batches(batch)
        packs = [pack(m, self.sequence_multiple) for m in micro] if self.cfg.pack_sequences else [None] * len(micro)
        outputs: list[torch.Tensor] = []
        # Megatron DDP averages gradients over data-parallel ranks; losses are shares of the global batch (the
        # schedule itself makes up for the average over context-parallel ranks)
        scale = len(micro) * self.dp_size
        routes = Routes(model) if replay and self.replays_routes() and ROUTED_EXPERTS in batch else None

        def forward_step(data_iterator, chunk):
            index_of_micro, mb, packed = next(data_iterator)
            # a vision-language model also takes each row's images (rlcore.multimodal), from the rows' metadata
            more = {} if self.spec.vision is None else {"images": [r.get(IMAGE_INPUTS) for r in mb.meta] or None}
            tokens = (router_tokens(mb, packed, self._cp_index if self.cp_size > 1 else None, self.cfg.parallel)
                      if routes or recorder else None)
            if routes is not None and tokens is not None:
                routes.replay(picked(mb[ROUTED_EXPERTS], tokens))
            if packed is not None:   # one row, sequences end to end; outputs go back to the micro-batch's layout
                labels = packed.labels
                output = chunk(packed.ids, packed.positions, None, packed_seq_params=packed.params, **more)
            else:
                ids = mb["input_ids"]
                labels = torch.roll(ids, -1, dims=1)
                positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
                if self.cp_size > 1:   # this rank's zigzag chunks of every per-token tensor
                    index = self._cp_index(ids.shape[1])
                    mb = _select_columns(mb, index)
                    ids, labels, positions = ids[:, index], labels[:, index], positions[:, index]
                output = chunk(ids, positions, None, **more)
            if recorder is not None and tokens is not None:
                recorder.record(tokens, rows[index_of_micro])

            def loss_func(output):
                per_token, more = self.token_outputs(output, labels, extras)
                if packed is not None:
                    per_token, more = unpack(per_token, packed), {k: unpack(v, packed) for k, v in more.items()}
                if loss_fn is None:
                    outputs.append(per_token.detach())
                    return per_token.sum() * 0.0, {}
                loss, metrics = loss_fn(per_token, mb, **more)
                return loss * scale, metrics  # the schedule divides by the number of micro-batches

            return output, loss_func

        shapes = [p.ids.shape if p is not None else m["input_ids"].shape for m, p in zip(micro, packs)]
        with hook(model) if hook else nullcontext(), routes or nullcontext():
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(zip(range(len(micro)), micro, packs)),
                model=[model],
                num_microbatches=len(micro), seq_length=max(s[1] for s in shapes) // self.cp_size,
                micro_batch_size=max(s[0] for s in shapes), forward_only=forward_only)
        return results, list(zip(rows, outputs)), _padding_fraction(batch, sum(a * b for a, b in shapes), rows)

    def _micro_batches(self, batch: Batch) -> tuple[list[Batch], list[list[int]]]:
        """The micro-batches of ``batch`` and the rows of ``batch`` each holds (in order; padding rows not listed).
        Fixed size: ``micro_batch_size`` consecutive rows (the last one filled up with zero-mask copies: pipeline
        schedules need equal shapes). Token budget: ``rlcore.balance`` packs rows longest first, the count is
        raised to the data-parallel ranks' largest, and each micro-batch is cut to its longest row (packed
        sequences: up to the budget in tokens, first fit, longest first)."""
        from megatron.core import parallel_state as mpu

        budget = self.cfg.max_tokens_per_micro_batch
        if not budget:
            mbs = min(self.cfg.micro_batch_size, len(batch))
            rows = [list(range(i, min(i + mbs, len(batch)))) for i in range(0, len(batch), mbs)]
            return _pad_rows(_pad_columns(batch, self.sequence_multiple), mbs).split(mbs), rows
        width, lengths = batch["input_ids"].shape[1], sequence_lengths(batch).tolist()
        rows = token_budget_micro_batches(lengths, budget, packed=self.cfg.pack_sequences)
        count = torch.tensor([len(rows)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group_gloo())
        rows = split_to_count(rows, lengths, int(count.item()))
        micro = []
        for part in rows:
            sub = batch.select(part or [0])
            if not part:            # nothing left for this rank: a row that adds nothing keeps the count
                sub.tensors["response_mask"] = torch.zeros_like(sub["response_mask"])
            cut = min(width, max(lengths[i] for i in (part or [0])))
            micro.append(_pad_columns(_select_columns(sub, torch.arange(cut)), self.sequence_multiple))
        return micro, rows

    def _cp_index(self, length: int) -> torch.Tensor:
        from rlcore.megatron.attention import zigzag_positions

        return zigzag_positions(self.cp_group.rank(), self.cp_size, length // (2 * self.cp_size))

    def _cp_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token values of this rank's chunks -> the whole sequence, on every CP rank."""
        from rlcore.megatron.attention import zigzag_positions

        pieces = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(pieces, local.contiguous(), group=self.cp_group)
        chunk = local.shape[1] // 2
        full = local.new_empty(local.shape[0], local.shape[1] * self.cp_size)
        for r, piece in enumerate(pieces):
            full[:, zigzag_positions(r, self.cp_size, chunk)] = piece
        return full

    @torch.no_grad()
    def per_token(self, model, batch: Batch, hook=None, recorder: RoutingRecorder | None = None,
                  replay: bool = True) -> torch.Tensor:
        """The pass's per-token output [N, S] (label positions) for the whole share. Computed on the last pipeline
        stage and broadcast to the others, so every rank returns it."""
        was_training = model.training
        model.eval()
        _, outputs, _ = self._run(model, batch, None, forward_only=True, hook=hook, recorder=recorder,
                                  replay=replay)
        model.train(was_training)
        full_len = batch["input_ids"].shape[1]
        result = torch.zeros(batch["input_ids"].shape) if outputs else torch.empty(batch["input_ids"].shape)
        for rows, output in outputs:
            if self.cp_size > 1:
                output = self._cp_gather(output)
            width = min(full_len, output.shape[1])
            result[rows, :width] = output[: len(rows), :width]
        if self.pp_size > 1:
            dist.broadcast(result, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        return result

    def train_step(self, batch: Batch, loss_fn: LossFn, extras: bool = False, hook=None) -> dict[str, float]:
        """One optimizer update on ``batch`` (this rank's share of a mini-batch). Returns the mean of the
        micro-batch metrics (on the last pipeline stage; other stages return only the update's metrics)."""
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} was built without an optimizer: it only scores")
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        results, _, padding = self._run(self.ddp, batch, loss_fn, forward_only=False, extras=extras, hook=hook)
        lr = learning_rate(self.updates, self.cfg.optim, self.total_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ok, grad_norm, _ = self.optimizer.step()
        self.updates += 1
        metrics: dict[str, float] = {}
        for r in results:
            for k, v in r.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(results)
        metrics[f"{self.role}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics[f"{self.role}/update_skipped"] = 0.0 if ok else 1.0
        metrics[f"{self.role}/lr"] = lr
        metrics[f"{self.role}/padding_frac"] = padding
        return metrics
