"""The Megatron critic: a GPTModel of the actor's family whose vocabulary projection is replaced by a scalar value
head, read per token as V(state before the next token)."""
from __future__ import annotations

import torch

from rlcore.data import Batch
from rlcore.megatron.trainable import MegatronTrainable


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1], in the output layer's place and call signature. The head is the same
    on every TP rank. Under sequence parallelism each rank sees a slice of the sequence: the values are gathered
    (the backward keeps each rank's slice, as every rank computes the same loss) and the head's gradient is summed
    over TP ranks by Megatron's finalize step (it reduces parameters marked ``sequence_parallel``). Its parameters
    are named as the output layer's (``output_layer.weight`` / ``.bias``), which Megatron's checkpointing expects."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        # V = 0 to start: no made-up preferences before any return
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            setattr(p, "sequence_parallel", sequence_parallel)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


class MegatronCritic(MegatronTrainable):
    role = "critic"

    def build(self, hf_state):
        """The actor family's model with its weights (from the critic's checkpoint), then the value head in place
        of the output layer on the last pipeline stage (untied from the embedding, if the family ties them)."""
        model, converter = super().build(hf_state)
        model.share_embeddings_and_output_weights = False
        if model.post_process:
            model.output_layer = ValueHead(model.config.hidden_size, model.config.sequence_parallel,
                                           model.config.params_dtype)
        return model, converter

    def token_outputs(self, values, labels, extras):
        return values.squeeze(-1).float(), {}

    def values(self, batch: Batch) -> torch.Tensor:
        """V at every label position [N, S] (the value of the state that predicts the next token), on every rank."""
        return self.per_token(self.ddp, batch)

