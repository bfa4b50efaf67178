"""Loss aggregation shared by every algorithm.

Megatron runs a mini-batch as several micro-batches and sums their gradients, dividing each micro-batch loss by
the number of micro-batches. ``aggregate`` therefore returns each micro-batch's exact *share* of the mini-batch
loss, computed against mini-batch totals, so the sum over micro-batches equals the loss of the whole mini-batch
regardless of how it is split.
"""
from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float,
              total_sequences: float) -> torch.Tensor:
    """token-mean: every response token of the mini-batch weighs the same.
    seq-mean-token-mean: each sequence's mean over its tokens, then the mean over sequences.
    seq-mean-token-sum: each sequence's sum over its tokens, then the mean over sequences."""
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / max(total_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(total_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / max(total_sequences, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGG_MODES)}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
