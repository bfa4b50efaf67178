"""Padding-free micro-batches: a micro-batch's sequences laid end to end in one row (megatron-core's "thd" layout).

Attention stays within each sequence: ``SDPAttention`` runs one causal attention per sequence of the pack, and
megatron-core's unfused THD rotary embedding restarts positions at every sequence. Only the model sees the packed
row: its per-token outputs are put back in the micro-batch's [rows, width] layout before the loss, so every loss,
aggregation (sequence-mean modes included) and rollout correction works unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.data import Batch, sequence_lengths


@dataclass
class Packed:
    """One micro-batch packed into a row of ``ids.shape[1]`` positions; ``rows``/``cols`` say where each of the
    first ``len(rows)`` packed positions sits in the micro-batch (the rest is padding to a length multiple)."""
    ids: torch.Tensor          # [1, T]
    positions: torch.Tensor    # [1, T], restarting at 0 for every sequence
    labels: torch.Tensor       # [1, T], each position's label as in the unpacked micro-batch
    params: object             # megatron-core PackedSeqParams (cumulative sequence lengths)
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]     # the micro-batch's [rows, width]


def pack(batch: Batch, multiple: int = 1) -> Packed:
    """``batch``'s sequences end to end, padded at the end to a multiple of ``multiple`` positions (sequence
    parallelism splits the row over TP ranks); the padding belongs to the last sequence, after all of its tokens,
    so no real token attends to it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids = batch["input_ids"]
    lengths = sequence_lengths(batch)
    rows = torch.repeat_interleave(torch.arange(len(batch)), lengths)
    cols = torch.cat([torch.arange(int(n)) for n in lengths])
    real = len(rows)
    total = real + (-real % multiple)

    def packed(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(1, total)
        out[0, :real] = values[rows, cols]
        return out

    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    bounds[-1] = total
    longest = int((bounds[1:] - bounds[:-1]).max())
    cu = bounds.to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    positions = torch.zeros(1, total, dtype=torch.long)
    positions[0, :real] = cols
    return Packed(packed(ids), positions, packed(torch.roll(ids, -1, dims=1)), params, rows, cols,
                  (ids.shape[0], ids.shape[1]))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-token values of the packed row [1, T] -> the micro-batch's layout [rows, width] (0 at padding);
    differentiable."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values[0, :len(packed.rows)])
