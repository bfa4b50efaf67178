"""The Megatron actor: the policy, read per token as log-probabilities (and entropy), plus a frozen reference copy
when an algorithm asks for one (with LoRA, the model itself with its adapters off), and the resharder that streams
its weights to the rollout engine (with LoRA, the merged weights).

Log-probabilities come from vocab-parallel cross-entropy (logp = -CE), exact under tensor parallelism without
gathering the vocabulary.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

import torch

from rlcore.config.schema import ActorConfig
from rlcore.data import Batch
from rlcore.converted import ConvertedWeights
from rlcore.lora.config import lora_config
from rlcore.lora.config import LoRAConfig
from rlcore.lora.layers import adapters, adapters_enabled
from rlcore.megatron.model import build_gpt
from rlcore.megatron.reshard import Resharder
from rlcore.megatron.routing_replay import RoutingRecorder
from rlcore.megatron.host_memory import to_device, to_host
from rlcore.megatron.trainable import LossFn, MegatronTrainable
from rlcore.megatron.output_chunks import OutputHead, reading_tokens, token_stats
from rlcore.specs import ModelSpec, OptimizerSpec


class MegatronActor(MegatronTrainable):
    role = "actor"
    cfg: ActorConfig

    def __init__(self, spec: ModelSpec, hf_config: dict, cfg: ActorConfig, optimizer: OptimizerSpec,
                 hf_state: Mapping[str, torch.Tensor] | ConvertedWeights | None = None, seed: int = 0,
                 bucket_bytes: int = 256 << 20,
                 sync_transport: str = "auto", total_updates: int = 0):
        super().__init__(spec, hf_config, cfg, optimizer, hf_state, seed, total_updates)
        self.reference: torch.nn.Module | None = None
        self.reference_is_base = False    # LoRA: the reference policy is this model with its adapters off
        self._parked_reference: list[tuple[torch.Tensor, torch.Tensor]] = []   # its params' host copies, if offloaded
        self._head: OutputHead | None = None
        self.resharder = Resharder(self.model, self.converter, bucket_bytes, sync_transport)

    def lora_config(self, seed: int) -> LoRAConfig | None:
        return lora_config(self.cfg.lora, seed)

    def replays_routes(self) -> bool:
        return self.cfg.moe.routing_replay == "rollout"

    def frozen_parts(self) -> tuple[str, ...]:
        return tuple(self.cfg.freeze)

    def token_outputs(self, output, labels, extras):
        """logp of each label; with ``extras`` also the policy's entropy (with grad only when it is trained on:
        ``actor.entropy_coef`` > 0). ``output`` is what the model returns inside ``_reading_tokens``: logits, or,
        for a micro-batch of more than ``actor.logprob_chunk_tokens`` tokens, hidden states read chunk by chunk."""
        assert self._head is not None, "the actor reads tokens only inside _reading_tokens"
        logp, h = token_stats(output, self._head, labels, with_entropy=extras, entropy_grad=self.cfg.entropy_coef > 0)
        return logp, {"entropy": h} if extras else {}

    @contextmanager
    def _reading_tokens(self, model, temperature: float):
        """Passes of ``model`` inside read the sampling policy at ``temperature``: softmax(logits / T), as the
        engine's processed logprobs."""
        with reading_tokens(model, temperature, self.cfg.logprob_chunk_tokens) as head:
            self._head = head
            try:
                yield
            finally:
                self._head = None

    # --- weights -----------------------------------------------------------------------------------------------
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, bucket by bucket. Collective: every rank must consume the whole stream."""
        return self.resharder.stream()

    def save_hf(self, directory: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Collective; global rank 0 writes the HF checkpoint as the weights stream by, one bucket in memory."""
        self.resharder.write_hf(self.hf_config, directory, max_shard_bytes)

    def num_parameters(self) -> int:
        """Parameters of the whole model (all shards, all stages), as the HF checkpoint counts them."""
        return sum(e.full_numel for b in self.resharder.buckets for e in b.entries)

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current weights as the reference policy (for KL terms); with
        ``actor.offload.reference`` it lives on the host and comes to the device only for its passes. With LoRA
        the base weights never change: the reference is the model with its adapters off, no copy."""
        if any(True for _ in adapters(self.model)):
            self.reference_is_base = True
            return
        reference, _ = build_gpt(self.spec, self.hf_config, self.cfg.dtype, self.cfg.parallel.sp,
                                 self.cfg.parallel.last_stage_layers, routing_replay=self.replays_routes())
        reference.load_state_dict(self.model.state_dict(), strict=False)
        self.reference = reference.requires_grad_(False).eval()
        self._parked_reference = to_host(list(reference.parameters())) if self.cfg.offload.reference_on_host() else []

    @contextmanager
    def _reference_on_device(self):
        """The reference's parameters on the device inside, back on the host after (where it is offloaded)."""
        to_device(self._parked_reference)
        try:
            yield
        finally:   # frozen: the host copies stay current, only the device storage goes
            for t, _ in self._parked_reference:
                t.untyped_storage().resize_(0)

    # --- passes ------------------------------------------------------------------------------------------------
    def logprobs(self, batch: Batch, reference: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Per-label-position logprobs [N, S] of the actor (or the frozen reference) at ``temperature``, on every
        rank."""
        context: AbstractContextManager
        if reference and self.reference_is_base:
            model, context = self.ddp, adapters_enabled(self.model, False)
        else:
            model, context = (self.reference, self._reference_on_device()) if reference else (self.ddp, nullcontext())
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference policy was frozen")
        with context:
            return self.per_token(model, batch, hook=lambda m: self._reading_tokens(m, temperature))

    def routing(self, batch: Batch, temperature: float = 1.0, replay: bool = False, keep: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A forward pass routed live (or, with ``replay``, replaying the batch's routes where the actor does): its
        logprobs [N, S], per token position the number of MoE layers whose experts differ from the batch's routed
        experts [N, S], and with ``keep`` the experts used [N, S, layers, top_k]; on every rank."""
        from megatron.core import parallel_state as mpu

        recorder = RoutingRecorder(self.ddp, batch, keep)
        try:
            logp = self.per_token(self.ddp, batch, hook=lambda m: self._reading_tokens(m, temperature),
                                  recorder=recorder, replay=replay)
        finally:
            recorder.close()
        differing, routed = recorder.result(mpu.get_tensor_model_parallel_group(), self.cp_group, self.pp_group)
        return logp, differing, routed

    def train_step(self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0,
                   entropy: bool = False) -> dict[str, float]:
        """One update; ``loss_fn(logp, mb)``, or ``loss_fn(logp, mb, entropy=...)`` when ``entropy``."""
        return super().train_step(batch, loss_fn, extras=entropy,
                                  hook=lambda m: self._reading_tokens(m, temperature))
