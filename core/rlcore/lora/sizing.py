"""What ``actor.lora``'s adapters add to a model's memory, per rank (``--dry-run``; ``rlcore.sizing``), and what
they cannot adapt in a model, refused before anything starts."""
from __future__ import annotations

from rlcore.config import Config
from rlcore.lora.config import MLA_TARGETS


def _attention_linears(c) -> dict[str, tuple[int, int, bool]]:
    """The attention's linears by megatron-core name: (input width, output width, column-parallel). Multi-latent
    attention's are all column-parallel in megatron-core's local spec (the down projections too), the output
    projection row-parallel."""
    h, n = c.hidden_size, c.num_attention_heads
    if getattr(c, "multi_latent_attention", False):
        qk = c.qk_head_dim + c.qk_pos_emb_head_dim
        query = ({"linear_q_down_proj": (h, c.q_lora_rank, True), "linear_q_up_proj": (c.q_lora_rank, n * qk, True)}
                 if c.q_lora_rank else {"linear_q_proj": (h, n * qk, True)})
        return {**query, "linear_kv_down_proj": (h, c.kv_lora_rank + c.qk_pos_emb_head_dim, True),
                "linear_kv_up_proj": (c.kv_lora_rank, n * (c.qk_head_dim + c.v_head_dim), True),
                "linear_proj": (n * c.v_head_dim, h, False)}
    attention = n * c.kv_channels
    return {"linear_qkv": (h, attention + 2 * c.num_query_groups * c.kv_channels, True),
            "linear_proj": (attention, h, False)}


def _adapted_linears(c, target_modules, moe: bool, tp: int) -> list[tuple[int, int, bool]]:
    """(input width, output width, column-parallel) of each linear of a layer that ``actor.lora`` adapts split over
    TP; on a MoE layer ``linear_fc1``/``linear_fc2`` are its shared experts' here (if it has any) and its routed
    experts' in ``_adapted_expert_linears``."""
    h, ffn = c.hidden_size, c.ffn_hidden_size
    widths = _attention_linears(c)
    if moe:
        ffn = c.moe_shared_expert_intermediate_size or 0
    if ffn:
        widths |= {"linear_fc1": (h, ffn * (2 if c.gated_linear_unit else 1), True), "linear_fc2": (ffn, h, False)}
    return [widths[t] for t in target_modules if t in widths]


def _adapted_expert_linears(c, target_modules) -> list[tuple[int, int]]:
    """(input width, output width) of each linear of one routed expert that ``actor.lora`` adapts: whole on its EP
    rank (expert TP is 1)."""
    h, ffn = c.hidden_size, c.moe_ffn_hidden_size
    widths = {"linear_fc1": (h, ffn * (2 if c.gated_linear_unit else 1)), "linear_fc2": (ffn, h)}
    return [widths[t] for t in target_modules if t in widths]


def adapter_params(c, rank: int, target_modules, moe: bool, tp: int, ep: int = 1) -> float:
    """One rank's LoRA parameters in one layer: A [r, in] and B [out, r] per adapted linear, the factor on W's split
    side divided over TP (column: B; row: A), the other replicated (``rlcore.lora.layers``); on a MoE layer also
    the adapters of the routed experts on one EP rank (``expert_adapter_params``)."""
    return sum(rank * (i + o / tp) if column else rank * (i / tp + o)
               for i, o, column in _adapted_linears(c, target_modules, moe, tp)) + \
        expert_adapter_params(c, rank, target_modules, moe, ep)


def expert_adapter_params(c, rank: int, target_modules, moe: bool, ep: int) -> float:
    """The LoRA parameters of one EP rank's routed experts in one layer (num_experts / ep experts, each its own
    A and B); 0 on a dense layer."""
    if not moe:
        return 0.0
    return c.num_moe_experts / ep * sum(rank * (i + o) for i, o in _adapted_expert_linears(c, target_modules))


def lora_problems(c, cfg: Config) -> list[str]:
    """What ``actor.lora`` asks of this model that the adapters cannot do yet (the run would fail building them)."""
    lora = cfg.actor.lora
    if not lora.rank:
        return []
    problems = []
    attention = _attention_linears(c)
    absent = [t for t in lora.target_modules if t in ("linear_qkv", *MLA_TARGETS) and t not in attention]
    if absent:
        problems.append(f"actor.lora.target_modules names {', '.join(absent)}, which this model's attention does not "
                        f"have; its linears are {', '.join(attention)}")
    return problems
