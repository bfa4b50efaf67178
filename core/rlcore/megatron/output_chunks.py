"""The policy's per-token log-probabilities and entropy from its last hidden states, a chunk of tokens at a time.

The output layer is applied per chunk, so the [tokens x vocab/tp] logits (and their float32 copies) exist for one
chunk only; when training on several chunks, each chunk's logits are recomputed in the backward pass instead of kept.
Inside ``hidden_states_out`` the model returns its last hidden states rather than logits; the communication the
output layer does on its input (the sequence-parallel all-gather, or the tensor-parallel gradient all-reduce) is
done there, so ``chunked_token_stats`` multiplies by this rank's vocabulary slice exactly as the layer would.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rlcore.megatron.vocab_parallel import entropy, label_logprobs


@dataclass
class OutputHead:
    """What turns hidden states into this rank's logits: the output weight (the embedding's when tied), set by the
    forward that returned the hidden states, and the sampling temperature the logits are divided by."""
    temperature: float = 1.0
    weight: torch.Tensor | None = None


@contextmanager
def hidden_states_out(model, temperature: float = 1.0) -> Iterator[OutputHead | None]:
    """While inside, ``model`` (on the last pipeline stage) returns its last hidden states [b, s, h], whole over
    the sequence on every TP rank, and the yielded head holds the weight its output layer would have used. Yields
    None on other stages (no output layer)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    layers = [m for name, m in model.named_modules() if name.endswith("output_layer")]
    if not layers:
        yield None
        return
    layer, head = layers[0], OutputHead(temperature)

    def forward(hidden, weight=None, runtime_gather_output=None):
        head.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:       # backward: reduce-scatter, as the layer's own
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        elif layer.tp_group.size() > 1:   # backward: all-reduce of the input's gradient
            hidden = _SumGradOverTP.apply(hidden, layer.tp_group)
        return hidden, None

    layer.forward = forward               # an instance attribute: the class's forward is back after `del`
    try:
        yield head
    finally:
        del layer.forward


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP ranks in backward (each rank's holds its vocabulary slice's
    share). Not megatron-core's copy_to_tensor_model_parallel_region: that all-reduces a contiguous copy and returns
    the gradient unreduced when it is not contiguous, as it is here behind GPTModel's [s, b] -> [b, s] transpose."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
           with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.matmul(hidden, weight.t())
    if temperature != 1.0:
        logits = logits / temperature
    if not with_entropy:
        return label_logprobs(logits, labels), logits.new_empty(0)
    if entropy_grad:   # the cross-entropy overwrites its input, which the entropy's backward needs
        return label_logprobs(logits.clone(), labels), entropy(logits)
    with torch.no_grad():
        h = entropy(logits.detach())
    return label_logprobs(logits, labels), h


def chunked_token_stats(hidden: torch.Tensor, head: OutputHead, labels: torch.Tensor, chunk_tokens: int,
                        with_entropy: bool = False, entropy_grad: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [b, s] (and the entropy [b, s] when ``with_entropy``) from hidden states [b, s, h], at most
    ``chunk_tokens`` tokens' logits at a time (0: all at once). Collective over TP ranks (every chunk reduces over
    the vocabulary slices), so every rank must pass the same shapes and chunk size."""
    assert head.weight is not None, "chunked_token_stats needs the head of a forward inside hidden_states_out"
    b, s, h = hidden.shape
    flat_hidden, flat_labels = hidden.reshape(b * s, h), labels.reshape(b * s)
    size = chunk_tokens if 0 < chunk_tokens < b * s else b * s
    recompute = torch.is_grad_enabled() and size < b * s
    logps, entropies = [], []
    for start in range(0, b * s, size):
        args = (flat_hidden[start:start + size], head.weight, flat_labels[start:start + size], head.temperature,
                with_entropy, entropy_grad)
        logp, ent = (checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False) if recompute
                     else _chunk(*args))
        logps.append(logp)
        entropies.append(ent)
    logp = torch.cat(logps).view(b, s)
    return logp, torch.cat(entropies).view(b, s) if with_entropy else None
