"""The policy's per-token log-probabilities and entropy, with the [tokens x vocab/tp] logits a chunk of tokens at a
time when a micro-batch holds more tokens than one chunk.

Inside ``reading_tokens`` the model's output layer decides per micro-batch: one that fits in a chunk gets the layer's
own logits (divided by the sampling temperature), exactly as without chunking; a larger one gets its last hidden
states instead, and ``token_stats`` applies the output layer chunk by chunk, so the logits (and their float32 copies)
exist for one chunk only, and in training each chunk's logits are recomputed in the backward pass instead of kept.
For hidden states, the communication the output layer does on its input (the sequence-parallel all-gather, or the
tensor-parallel gradient sum) is done here, so each chunk multiplies by this rank's vocabulary slice as the layer
would.
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
    """How to read the model's output of the current micro-batch: logits (``weight`` None), or hidden states to
    multiply by ``weight`` (the output layer's, or the embedding's when tied) ``chunk_tokens`` tokens at a time."""
    temperature: float = 1.0
    chunk_tokens: int = 0
    weight: torch.Tensor | None = None


@contextmanager
def reading_tokens(model, temperature: float = 1.0, chunk_tokens: int = 0) -> Iterator[OutputHead | None]:
    """While inside, ``model``'s output layer (on the last pipeline stage) returns, per micro-batch, its logits at
    ``temperature`` (at most ``chunk_tokens`` tokens, or 0 = no limit) or else the last hidden states [b, s, h], whole
    over the sequence on every TP rank; the yielded head says which, for ``token_stats``. Yields None on other stages
    (no output layer)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    layers = [m for name, m in model.named_modules() if name.endswith("output_layer")]
    if not layers:
        yield None
        return
    layer, head = layers[0], OutputHead(temperature, chunk_tokens)
    tp = layer.tp_group.size()
    original = layer.forward

    def forward(hidden, weight=None, runtime_gather_output=None):
        tokens = hidden.shape[0] * hidden.shape[1] * (tp if layer.sequence_parallel else 1)
        if not chunk_tokens or tokens <= chunk_tokens:    # one chunk: the layer's own logits
            head.weight = None
            logits, bias = original(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
            if logits.requires_grad:
                # the gradient made contiguous before the output layer's backward: it arrives as a view behind
                # GPTModel's [s, b] -> [b, s] transpose, and the layer multiplies it by its 2-D weight with
                # torch.matmul, which folds a non-contiguous 3-D operand into one matrix product only when the weight
                # requires grad: for a frozen weight (LoRA's base; megatron-core's LinearWithFrozenWeight) it
                # broadcast the weight to [s, vocab/tp, hidden] (8.1 GB for 32 positions of Qwen2.5-0.5B). A trained
                # weight's path copies the gradient the same way already. A tensor hook, not an autograd Function:
                # the logits' views are modified in place downstream, which a Function's output may not be
                logits.register_hook(torch.Tensor.contiguous)
            return (logits / temperature if temperature != 1.0 else logits), bias
        head.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:       # backward: reduce-scatter, as the layer's own
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        elif tp > 1:                      # backward: the sum of the ranks' input gradients
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


def _stats(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool,
           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not with_entropy:
        return label_logprobs(logits, labels), None
    if entropy_grad:   # the cross-entropy overwrites its input, which the entropy's backward needs
        return label_logprobs(logits.clone(), labels), entropy(logits)
    with torch.no_grad():
        h = entropy(logits.detach())
    return label_logprobs(logits, labels), h


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
           with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.matmul(hidden, weight.t())
    if temperature != 1.0:
        logits = logits / temperature
    logp, h = _stats(logits, labels, with_entropy, entropy_grad)
    return logp, logits.new_empty(0) if h is None else h


def token_stats(output: torch.Tensor, head: OutputHead, labels: torch.Tensor, with_entropy: bool = False,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [b, s] (and the entropy [b, s] when ``with_entropy``) from the model's output inside
    ``reading_tokens``: its logits [b, s, V/tp], or its hidden states [b, s, h] taken ``head.chunk_tokens`` tokens at
    a time. Collective over TP ranks (every chunk reduces over the vocabulary slices)."""
    if head.weight is None:
        return _stats(output, labels, with_entropy, entropy_grad)
    b, s, h = output.shape
    flat_hidden, flat_labels, size = output.reshape(b * s, h), labels.reshape(b * s), head.chunk_tokens
    recompute = torch.is_grad_enabled()
    logps, entropies = [], []
    for start in range(0, b * s, size):
        args = (flat_hidden[start:start + size], head.weight, flat_labels[start:start + size], head.temperature,
                with_entropy, entropy_grad)
        logp, ent = (checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False) if recompute
                     else _chunk(*args))
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps).view(b, s), torch.cat(entropies).view(b, s) if with_entropy else None
