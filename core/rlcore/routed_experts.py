"""Routed experts: which experts each MoE layer of the rollout engine sent each token to, so that the learner's MoE
layers can replay them (``actor.moe.routing_replay=rollout``, routing replay, "R3").

The engine side of the contract: a completion's ``routed_experts`` is an int tensor [n, layers, top_k] for the n
tokens the engine ran the model on, in order (the prompt and every sampled token but the last, which was never fed
back: n = len(prompt) + len(response) - 1), over the model's MoE layers in order (dense layers have no row), each
row the top-k expert ids (any order; the engines here sort them). A request resumed after a partial pause, or a
multi-turn episode's next turn, covers the tokens it was sent again: only the rows of tokens that were not routed before
are new (``joined``), so a token keeps the route that produced what was sampled after it.

In the training batch (``to_batch``) they are ``ROUTED_EXPERTS`` [rows, width, layers, top_k] int16 by token
position (not label position: a token's route belongs to the forward at that token), -1 where a position has none
(padding, and a trajectory's last token).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

ROUTED_EXPERTS = "routed_experts"   # the batch's per-token routes, and the metrics' prefix
DTYPE = torch.int16                  # expert ids < 32768: every published MoE (DeepSeek-V3: 256)
MISSING = -1


def as_routes(routes) -> torch.Tensor:
    """An engine's routes (a tensor or array of any int dtype) [n, layers, top_k] in the compact dtype."""
    routes = torch.as_tensor(routes)
    if routes.dim() != 3:
        raise ValueError(f"routed experts must be [tokens, MoE layers, top_k], got shape {tuple(routes.shape)}")
    return routes.to(DTYPE)


def joined(before: torch.Tensor | None, after: torch.Tensor | None) -> torch.Tensor | None:
    """The routes of a sequence that was sent again longer (a resumed request, the next turn): ``before``'s rows,
    then ``after``'s rows for the tokens ``before`` did not cover. None if either is None (a part without routes
    leaves the whole without them, rather than with a gap)."""
    if before is None or after is None:
        return None
    if after.shape[1:] != before.shape[1:]:
        raise ValueError(f"routed experts of one sequence changed shape: {tuple(before.shape[1:])} then "
                         f"{tuple(after.shape[1:])} (MoE layers, top_k)")
    return torch.cat([before, after[len(before):]])


def batch_routes(routes: Sequence[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """The batch's ``ROUTED_EXPERTS`` [rows, width, layers, top_k] from each trajectory's routes (-1 past them);
    None when no trajectory has routes. A trajectory without them gets -1 everywhere (``routing/rows_incomplete``
    counts such rows: their tokens run through filler experts)."""
    shape = next((tuple(r.shape[1:]) for r in routes if r is not None), None)
    if shape is None:
        return None
    out = torch.full((len(routes), width, *shape), MISSING, dtype=DTYPE)
    for i, r in enumerate(routes):
        if r is not None:
            if tuple(r.shape[1:]) != shape:
                raise ValueError(f"routed experts of one batch differ in shape: {shape} and {tuple(r.shape[1:])}")
            n = min(len(r), width)
            out[i, :n] = r[:n]
    return out


def differing(learner: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """Per token and layer: whether the learner's expert set differs from the rollout's ([..., layers, top_k] each,
    any order within top_k) -> bool [..., layers]; positions where the rollout has no route count as equal."""
    same = (learner.sort(-1).values == rollout.sort(-1).values).all(-1)
    return ~same & (rollout >= 0).all(-1)


def route_bytes(tokens: int, layers: int, top_k: int) -> int:
    """What carrying ``tokens`` tokens' routes costs (the batch's dtype)."""
    return tokens * layers * top_k * torch.tensor([], dtype=DTYPE).element_size()


def hf_moe_layers(hf_config: dict) -> list[int]:
    """The 0-based numbers of the MoE decoder layers of the model of a HF ``config.json`` (a vision-language model's:
    of its ``text_config``), by the conventions of the MoE families rlcore serves: DeepSeek-V3's
    ``first_k_dense_replace`` and ``moe_layer_freq``, Qwen2/Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, every layer otherwise (Mixtral). For engines that return a row for every decoder layer
    (SGLang, vLLM: zeros in the dense ones)."""
    hf = hf_config.get("text_config") or hf_config
    layers = range(hf["num_hidden_layers"])
    if "first_k_dense_replace" in hf or "moe_layer_freq" in hf:
        dense, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        return [i for i in layers if i >= dense and i % freq == 0]
    if "mlp_only_layers" in hf or "decoder_sparse_step" in hf:
        dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step") or 1
        return [i for i in layers if i not in dense and (i + 1) % step == 0]
    return list(layers)


def from_engine(rows, hf_config: dict) -> torch.Tensor:
    """An engine's routes over every decoder layer [n, num_hidden_layers, top_k] (any int dtype) as a completion's:
    the MoE layers' rows only (``hf_moe_layers``), each row's ids sorted ascending, in the compact dtype."""
    if isinstance(rows, np.ndarray) and not rows.flags.writeable:     # np.frombuffer's: torch warns on those
        rows = rows.copy()
    rows = torch.as_tensor(rows)
    hf = hf_config.get("text_config") or hf_config
    if rows.dim() != 3 or rows.shape[1] != hf["num_hidden_layers"]:
        raise ValueError(f"an engine's routed experts must be [tokens, {hf['num_hidden_layers']} decoder layers, "
                         f"top_k], got shape {tuple(rows.shape)}")
    moe = hf_moe_layers(hf_config)
    return as_routes(rows.to(torch.int64)[:, moe].sort(-1).values)
