"""Shims for gaps in megatron-core (pinned: 0.16.1) that are not about CPU: they apply on GPUs too, whenever the
condition they name holds. Each is tested to be still needed (tests/megatron/test_cpu_shims.py). Context parallelism
without TransformerEngine lives in the attention module the layer specs use (rlcore.megatron.attention)."""
from __future__ import annotations

from rlcore.megatron.attention import have_transformer_engine


def apply() -> None:
    define_te_general_gemm_without_transformer_engine()
    if not have_transformer_engine():
        sequence_parallel_torch_norms()
        multi_latent_attention_without_transformer_engine()


def define_te_general_gemm_without_transformer_engine() -> None:
    """moe_utils imports ``te_general_gemm`` only when TransformerEngine is installed, yet the MoE router's gating
    function tests ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError. Define it as None so the router takes its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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


def multi_latent_attention_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MLA module sets ``HAVE_TE`` when its TE extension imports, which it does without TE
    (as mock classes); MLA's constructor then calls ``isinstance(linear_proj, <mock>)`` and raises TypeError."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
