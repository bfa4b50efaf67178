"""What routing replay (``actor.moe.routing_replay=rollout``) removes, measured every step: a forward pass of the
batch routed live (``ActorWorkers.live_routing``) against the engine's routes and logprobs. The update itself runs
with replay, so its ``rollout_corr/*`` metrics are the mismatch with replay; ``routing/live_*`` are the same metrics
without it."""
from __future__ import annotations

import torch

from rlcore.data import Batch, sequence_lengths
from rlcore.rollout_correction import PREFIX, mismatch_metrics
from rlcore.routed_experts import ROUTED_EXPERTS

METRICS = "routing/"


def routing_metrics(batch: Batch, live_logprobs: torch.Tensor, differing_layers: torch.Tensor) -> dict[str, float]:
    """``differing_layers`` [N, S]: per token position, the MoE layers whose live experts differ from the engine's.
    Over the positions the engine routed: the share of tokens routed differently in at least one layer
    (``token_differs_frac``) and of (token, layer) choices (``layer_differs_frac``); the logprob mismatch of the
    live pass over the trained tokens (``live_kl_k3`` ...); the rows whose routes miss a token the engine fed
    (``rows_incomplete``: those tokens ran through the learner's filler experts, not the engine's)."""
    routes = batch[ROUTED_EXPERTS]
    routed = (routes >= 0).all(-1).all(-1)                      # [N, S]
    fed = torch.arange(routed.shape[1]) < (sequence_lengths(batch) - 1).unsqueeze(1)
    layers = routes.shape[2]
    tokens = max(int(routed.sum()), 1)
    metrics = {METRICS + "token_differs_frac": float(((differing_layers > 0) & routed).sum()) / tokens,
               METRICS + "layer_differs_frac": float(differing_layers[routed].sum()) / (tokens * layers),
               METRICS + "rows_incomplete": float((fed & ~routed).any(-1).sum())}
    live = mismatch_metrics(live_logprobs, batch["rollout_logprobs"], batch["response_mask"])
    metrics.update({METRICS + "live_" + k[len(PREFIX):]: v for k, v in live.items()})
    return metrics
