"""Shims for gaps in megatron-core (pinned: 0.16.1) that are not about CPU: they apply on GPUs too, whenever the
condition they name holds. Each is tested to be still needed (tests/megatron/test_cpu_shims.py)."""
from __future__ import annotations


def apply() -> None:
    define_te_general_gemm_without_transformer_engine()
    if not _have_transformer_engine():
        context_parallel_attention_without_transformer_engine()
        sequence_parallel_torch_norms()


def _have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def define_te_general_gemm_without_transformer_engine() -> None:
    """moe_utils imports ``te_general_gemm`` only when TransformerEngine is installed, yet the MoE router's gating
    function tests ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError. Define it as None so the router takes its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def context_parallel_attention_without_transformer_engine() -> None:
    """megatron-core implements context parallelism only inside TransformerEngine's attention; its local
    DotProductAttention asserts context_parallel_size == 1. Without TE, let each rank attend from its own query
    chunks to the keys/values of the whole sequence: all-gather K and V over the CP group (backward:
    reduce-scatter, through Megatron's sequence-parallel gather) and mask causally in the load-balanced "zigzag"
    layout that megatron's RoPE and batch split use (rank r holds chunks r and 2*cp-1-r of 2*cp). K/V memory is
    O(full sequence) per rank: correct everywhere, ring attention it is not."""
    import torch

    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer import dot_product_attention as dpa

    if getattr(dpa.DotProductAttention, "_rlcore_cp", False):
        return
    init, forward = dpa.DotProductAttention.__init__, dpa.DotProductAttention.forward

    def __init__(self, config, *args, **kwargs):
        cp = config.context_parallel_size
        config.context_parallel_size = 1       # pass the constructor's assertion; forward handles cp
        try:
            init(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def cp_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                   packed_seq_params=None):
        cp = self.config.context_parallel_size
        if cp == 1:
            return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                           packed_seq_params)
        group = mpu.get_context_parallel_group()
        chunk = query.size(0) // 2
        positions = [zigzag_positions(r, cp, chunk) for r in range(cp)]
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=group)
        q_pos, k_pos = positions[group.rank()], torch.cat(positions)
        mask = (k_pos[None, :] > q_pos[:, None])[None, None]          # True = masked, [1, 1, sq, sk]
        return forward(self, query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)

    dpa.DotProductAttention.__init__ = __init__
    dpa.DotProductAttention.forward = cp_forward
    dpa.DotProductAttention._rlcore_cp = True


def zigzag_positions(rank: int, cp: int, chunk: int):
    """Sequence positions held by CP rank ``rank``: chunks ``rank`` and ``2*cp-1-rank`` of ``chunk`` tokens."""
    import torch

    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def sequence_parallel_torch_norms() -> None:
    """megatron-core's torch (non-TE) norms refuse sequence parallelism, though nothing in them depends on it: a norm
    is per token. Build them with the flag off and tag their parameters ``sequence_parallel`` so that
    ``finalize_model_grads`` all-reduces their gradients over the TP group (each TP rank saw only its part of the
    sequence), which is what TE's norms get."""
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_rlcore_sp", False):
        return
    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__
    torch_norm.WrappedTorchNorm._rlcore_sp = True
