"""The Megatron critic: a GPTModel of the actor's family whose vocabulary projection is replaced by a scalar value
head, read per token as V(state before the next token)."""
from __future__ import annotations

import torch

from rlcore.data import Batch
from rlcore.megatron.heads import with_scalar_head
from rlcore.megatron.trainable import MegatronTrainable


class MegatronCritic(MegatronTrainable):
    role = "critic"

    def build(self, hf_state):
        """The actor family's model with its weights (from the critic's checkpoint), then the value head in place
        of the output layer on the last pipeline stage (untied from the embedding, if the family ties them)."""
        model, converter = super().build(hf_state)
        return with_scalar_head(model), converter

    def token_outputs(self, values, labels, extras):
        return values.squeeze(-1).float(), {}

    def values(self, batch: Batch) -> torch.Tensor:
        """V at every label position [N, S] (the value of the state that predicts the next token), on every rank."""
        return self.per_token(self.ddp, batch)

