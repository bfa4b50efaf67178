"""The Megatron actor: the policy, read per token as log-probabilities (and entropy), plus a frozen reference copy
when an algorithm asks for one, and the resharder that streams its weights to the rollout engine.

Log-probabilities come from vocab-parallel cross-entropy (logp = -CE), exact under tensor parallelism without
gathering the vocabulary.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from rlcore.config.schema import ActorConfig
from rlcore.data import Batch
from rlcore.engine.reshard import Resharder
from rlcore.megatron.model import build_gpt, save_hf
from rlcore.megatron.trainable import LossFn, MegatronTrainable
from rlcore.megatron.vocab_parallel import entropy, label_logprobs
from rlcore.specs import ModelSpec, OptimizerSpec


@contextmanager
def logits_divided_by(model, temperature: float):
    """The sampling policy at temperature T is softmax(logits / T): scale the output layer's logits while inside.
    Logprobs computed this way match the engine's processed (post-temperature) logprobs."""
    layers = [m for name, m in model.named_modules() if name.endswith("output_layer")]
    if temperature == 1.0 or not layers:   # not the last pipeline stage: no logits here
        yield
        return
    handle = layers[0].register_forward_hook(lambda mod, inp, out: (out[0] / temperature, *out[1:]))
    try:
        yield
    finally:
        handle.remove()


class MegatronActor(MegatronTrainable):
    role = "actor"

    def __init__(self, spec: ModelSpec, hf_config: dict, cfg: ActorConfig, optimizer: OptimizerSpec,
                 hf_state: dict[str, torch.Tensor] | None = None, seed: int = 0, bucket_bytes: int = 256 << 20,
                 sync_transport: str = "auto", total_updates: int = 0):
        super().__init__(spec, hf_config, cfg, optimizer, hf_state, seed, total_updates)
        self.reference: torch.nn.Module | None = None
        self.resharder = Resharder(self.model, self.converter, bucket_bytes, sync_transport)

    def token_outputs(self, logits, labels, extras):
        """logp of each label; with ``extras`` also the policy's entropy (with grad only when it is trained on:
        ``actor.entropy_coef`` > 0). Megatron's cross-entropy works in place on its input, so the entropy is taken
        first, from the untouched logits (which its backward keeps: then the cross-entropy gets a copy)."""
        if not extras:
            return label_logprobs(logits, labels), {}
        if self.cfg.entropy_coef > 0:
            h = entropy(logits)
            return label_logprobs(logits.clone(), labels), {"entropy": h}
        with torch.no_grad():
            h = entropy(logits.detach())
        return label_logprobs(logits, labels), {"entropy": h}

    # --- weights -----------------------------------------------------------------------------------------------
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, bucket by bucket. Collective: every rank must consume the whole stream."""
        return self.resharder.stream()

    def save_hf(self, directory: str) -> None:
        """Collective; global rank 0 writes."""
        if dist.get_rank() == 0:
            save_hf(self.hf_weights(), self.hf_config, directory)
        else:
            for _ in self.hf_weights():
                pass

    def num_parameters(self) -> int:
        """Parameters of the whole model (all shards, all stages), as the HF checkpoint counts them."""
        return sum(e.full_numel for b in self.resharder.buckets for e in b.entries)

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current weights as the reference policy (for KL terms)."""
        reference, _ = build_gpt(self.spec, self.hf_config, self.cfg.dtype, self.cfg.parallel.sp,
                                 self.cfg.parallel.last_stage_layers)
        reference.load_state_dict(self.model.state_dict(), strict=False)
        self.reference = reference.requires_grad_(False).eval()

    # --- passes ------------------------------------------------------------------------------------------------
    def logprobs(self, batch: Batch, reference: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Per-label-position logprobs [N, S] of the actor (or the frozen reference) at ``temperature``, on every
        rank."""
        model = self.reference if reference else self.ddp
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference policy was frozen")
        return self.per_token(model, batch, hook=lambda m: logits_divided_by(m, temperature))

    def train_step(self, batch: Batch, loss_fn: LossFn, temperature: float = 1.0,
                   entropy: bool = False) -> dict[str, float]:
        """One update; ``loss_fn(logp, mb)``, or ``loss_fn(logp, mb, entropy=...)`` when ``entropy``."""
        return super().train_step(batch, loss_fn, extras=entropy,
                                  hook=lambda m: logits_divided_by(m, temperature))
