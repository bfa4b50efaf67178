"""Shims for gaps in megatron-core (pinned: 0.16.1) that are not about CPU: they apply on GPUs too, whenever the
condition they name holds. Each is tested to be still needed (tests/megatron/test_cpu_shims.py)."""
from __future__ import annotations


def apply() -> None:
    define_te_general_gemm_without_transformer_engine()


def define_te_general_gemm_without_transformer_engine() -> None:
    """moe_utils imports ``te_general_gemm`` only when TransformerEngine is installed, yet the MoE router's gating
    function tests ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError. Define it as None so the router takes its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
