"""A scalar head in the output layer's place: the critic's value head and a reward model's score head."""
from __future__ import annotations

import torch


class ScalarHead(torch.nn.Module):
    """hidden [s, b, h] -> [s, b, 1], in the output layer's place and call signature. The head is the same on every
    TP rank. Under sequence parallelism each rank sees a slice of the sequence: the outputs are gathered (the backward
    keeps each rank's slice, as every rank computes the same loss) and the head's gradient is summed over TP ranks by
    Megatron's finalize step (it reduces parameters marked ``sequence_parallel``). Its parameters are named as the
    output layer's (``output_layer.weight`` / ``.bias``), which Megatron's checkpointing expects. It starts at 0 (a
    value head: no made-up preferences before any return; a score head is loaded from its checkpoint)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, bias: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            setattr(p, "sequence_parallel", sequence_parallel)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def with_scalar_head(model, bias: bool = True):
    """``model`` with a ``ScalarHead`` in place of its output layer on the last pipeline stage, untied from the
    embedding (if the family ties them) on every stage."""
    model.share_embeddings_and_output_weights = False
    if model.post_process:
        model.output_layer = ScalarHead(model.config.hidden_size, model.config.sequence_parallel,
                                        model.config.params_dtype, bias)
    return model
