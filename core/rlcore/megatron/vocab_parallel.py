"""Per-token statistics of vocab-parallel logits (each TP rank holds a slice of the vocabulary): the label's
log-probability and the policy's entropy, exact without gathering the vocabulary."""
from __future__ import annotations

import torch
import torch.distributed as dist


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) [..., S] from logits [..., S, V/tp]; Megatron's vocab-parallel cross-entropy, negated. It
    overwrites float32 ``logits`` in place (with the softmax): read anything else off them first."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = log Z - sum_v p_v (z_v - m) per token, Z = sum_v exp(z_v - m), with Z and the sum reduced over the TP
    ranks' vocabulary slices and m the (detached) max logit. Differentiable: each rank's partial sums depend only on
    its own logits, so the all-reduce's backward is the identity. m leaves H unchanged; it keeps exp() finite, and
    weighting z - m rather than z keeps the fp32 value and gradient accurate at large logits (unshifted: 40-500x the
    error against fp64, tests/unit/megatron/test_vocab_parallel.py)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float()
    shift = z.detach().max(dim=-1, keepdim=True).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = z - shift
    e = torch.exp(shifted)
    partial = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
    total, weighted = reduce_from_tensor_model_parallel_region(partial)
    return torch.log(total) - weighted / total
