"""Decoder-layer specs for model plugins, with fused attention when TransformerEngine is absent.

megatron-core's local layer spec computes attention as explicit matmuls + softmax, materialising the [b, h, s, s]
score matrix: on one H100 (bf16, seq 4096) that reached MFU 0.054 / 0.108 on 0.6B / 1.7B Qwen3 shapes with
61-73 GB, where a core-attention module over torch's ``scaled_dot_product_attention`` reached 0.130 / 0.260 with
18-31 GB (../shared/notes/gpu-mfu.md). So: TransformerEngine's spec when it is installed, otherwise the local spec
with ``SDPAttention`` as its core attention. SDPA runs on CPU too, so the code that runs on GPUs is the code the CPU
tests exercise.

Context parallelism without TE: each rank attends from its own query chunks to the keys and values of the whole
sequence (all-gathered over the CP group; backward reduce-scatters through Megatron's sequence-parallel gather),
masked causally in the load-balanced "zigzag" layout that Megatron's RoPE and the actor's batch split use
(rank r holds chunks r and 2*cp-1-r of 2*cp). K/V memory is O(full sequence) per rank: correct everywhere, not ring
attention.
"""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def zigzag_positions(rank: int, cp: int, chunk: int) -> torch.Tensor:
    """Sequence positions held by CP rank ``rank``: chunks ``rank`` and ``2*cp-1-rank`` of ``chunk`` tokens."""
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


class SDPAttention(torch.nn.Module):
    """Megatron core attention (the ``core_attention`` submodule) over torch's scaled_dot_product_attention.
    Takes query [sq, b, heads, d], key/value [sk, b, groups, d] (value may have its own head dim, as in MLA) and
    returns [sq, b, heads * d_v], like megatron's DotProductAttention."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None, k_channels: int | None = None, v_channels: int | None = None):
        # k_channels / v_channels: MLA passes its head sizes (TE's signature); SDPA reads them off the tensors
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if config.window_size is not None or getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("SDPAttention supports full attention with a plain softmax only "
                                      f"(window_size={config.window_size}, softmax_type={config.softmax_type})")
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        keep = None if attention_mask is None else ~attention_mask     # Megatron masks True = hidden
        if self.config.context_parallel_size > 1:
            key, value, keep = self._whole_sequence_kv(query, key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))    # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, is_causal=self.causal and keep is None,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1))
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _packed(self, query, key, value, params):
        """Sequences packed end to end ("thd": query [t, heads, d], key/value [t, groups, d], boundaries in
        ``params.cu_seqlens_q``): one causal attention per sequence, so none attends to another. Returns
        [t, heads * d_v]."""
        if params.qkv_format != "thd" or self.config.context_parallel_size > 1:
            raise NotImplementedError("SDPAttention packs sequences in the thd format without context parallelism")
        bounds = params.cu_seqlens_q.tolist()
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))   # [1, h, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                 dropout_p=self.dropout if self.training else 0.0,
                                                 scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
            pieces.append(out[0].transpose(0, 1))                                                 # [s, h, d_v]
        out = torch.cat(pieces)
        return out.reshape(out.size(0), -1)

    def _whole_sequence_kv(self, query, key, value):
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        cp, group = self.config.context_parallel_size, mpu.get_context_parallel_group()
        chunk = query.size(0) // 2
        positions = [zigzag_positions(r, cp, chunk) for r in range(cp)]
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=group)
        q_pos, k_pos = positions[group.rank()].to(query.device), torch.cat(positions).to(query.device)
        return key, value, (k_pos[None, :] <= q_pos[:, None])[None, None]


def with_sdpa(spec):
    """Replace megatron's local core attention with ``SDPAttention`` in a layer spec or in every layer of a block
    spec (``TransformerBlockSubmodules``, as DeepSeek-style models with leading dense layers use)."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def gpt_layer_spec(num_experts: int | None = None, qk_layernorm: bool = False, multi_latent_attention: bool = False,
                   moe_grouped_gemm: bool = False):
    """The decoder-layer spec a model plugin should use: TransformerEngine's when installed, else the local spec
    with fused (SDPA) core attention."""
    from megatron.core.models.gpt import gpt_layer_specs

    if have_transformer_engine():   # its fused norm names are mapped by rlcore.convert (_TE_FUSED_NORMS)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention)
    return with_sdpa(gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention=multi_latent_attention))
