"""Routing replay in the learner: each MoE layer sends every token to the experts the rollout engine chose for it
(``rlcore.routed_experts``), through megatron-core's router replay (``moe_enable_routing_replay``: the router still
computes its scores, and the replayed experts' probabilities are gathered from them, so router gradients flow).

A micro-batch reaches a router as a flat list of tokens that depends on the layout: sequence-major ([S, b] flattened,
the model's [s, b, h] order), or one packed row; with context parallelism, this rank's zigzag chunks of each
sequence; with sequence parallelism, this tensor-parallel rank's contiguous share of that list. ``router_tokens``
says, for each token a router on this rank sees, its row and column in the micro-batch, so routes are picked by
token identity in every layout; pipeline stages hold their own layers and pick their layers' routes.

``Routes`` sets the replay targets before each micro-batch's forward; ``RoutingRecorder`` reads the routing the
layers actually used (replayed or live) back into the batch's [rows, S, layers, top_k] layout, for the metrics and
the tests that check replay layer by layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from rlcore.data import Batch
from rlcore.routed_experts import DTYPE, MISSING, ROUTED_EXPERTS, differing


def moe_layers(config) -> list[int]:
    """The 0-based numbers of the model's MoE layers (megatron-core's ``moe_layer_freq``: every N-th, or a list)."""
    if not config.num_moe_experts:
        return []
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i for i, moe in enumerate(pattern) if moe]


def routers(model) -> list[tuple[int, torch.nn.Module]]:
    """This rank's routers and each one's MoE layer index (its place among the model's MoE layers), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not found:
        return []
    index = {layer: i for i, layer in enumerate(moe_layers(found[0].config))}
    return [(index[r.layer_number - 1], r) for r in found]


@dataclass
class RouterTokens:
    """For each token a router on this rank sees, in its order: the micro-batch row and column it is (-1: padding)."""
    rows: torch.Tensor
    cols: torch.Tensor


def router_tokens(mb: Batch, packed=None, cp_columns: Callable[[int], torch.Tensor] | None = None,
                  parallel=None) -> RouterTokens:
    """The tokens this rank's routers see for the micro-batch ``mb`` [rows, S] given to the model as it is, or
    ``packed`` (``rlcore.megatron.packing.Packed``), or as the columns ``cp_columns(S)`` of each row (context
    parallelism); split over tensor-parallel ranks with sequence parallelism (``parallel``: the model's
    ``ParallelConfig``)."""
    if packed is not None:
        length = packed.ids.shape[1]
        rows = torch.full((length,), -1, dtype=torch.long)
        cols = torch.full((length,), -1, dtype=torch.long)
        rows[:len(packed.rows)], cols[:len(packed.cols)] = packed.rows, packed.cols
    else:
        count, width = mb["input_ids"].shape
        columns = torch.arange(width) if cp_columns is None else cp_columns(width)
        rows = torch.arange(count).repeat(len(columns))            # sequence-major: [s, b] flattened
        cols = columns.repeat_interleave(count)
    if parallel is not None and parallel.sp and parallel.tp > 1:
        from megatron.core import parallel_state as mpu

        share, rank = len(rows) // parallel.tp, mpu.get_tensor_model_parallel_rank()
        rows, cols = rows[rank * share:(rank + 1) * share], cols[rank * share:(rank + 1) * share]
    return RouterTokens(rows, cols)


def picked(routes: torch.Tensor, tokens: RouterTokens) -> torch.Tensor:
    """``routes`` [rows, W, layers, top_k] of a micro-batch -> [tokens, layers, top_k] in the routers' order, -1 for
    padding and for positions past W."""
    out = torch.full((len(tokens.rows), *routes.shape[2:]), MISSING, dtype=routes.dtype)
    real = (tokens.rows >= 0) & (tokens.cols < routes.shape[1])
    out[real] = routes[tokens.rows[real], tokens.cols[real]]
    return out


class Routes:
    """The routers of ``model`` (built with ``moe_enable_routing_replay``) replay routes, micro-batch by micro-batch,
    inside the context. A token without a route (padding, a sequence's last token) gets experts 0..k-1: its output
    is read by no loss, and distinct experts keep the dispatcher's counts whole."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.routers = routers(model)
        missing = [r.layer_number for _, r in self.routers if r.router_replay is None]
        if missing:
            raise RuntimeError(f"routing replay: the routers of layers {missing} were built without "
                               f"moe_enable_routing_replay")
        self.shape = (len(moe_layers(model.config)), model.config.moe_router_topk)
        self.action = RouterReplayAction.REPLAY_FORWARD

    def __enter__(self) -> "Routes":
        return self

    def replay(self, routes: torch.Tensor) -> None:
        """The next forward's routes: [tokens in the routers' order, layers, top_k] (``picked``)."""
        if tuple(routes.shape[1:]) != self.shape:
            raise ValueError(f"routing replay: the batch's routed experts are [tokens, {routes.shape[1]} layers, "
                             f"top-{routes.shape[2]}] but the model has {self.shape[0]} MoE layers routing top-"
                             f"{self.shape[1]}: the engine returned another model's routes")
        for layer, router in self.routers:
            target = routes[:, layer].long()
            filler = (target < 0).any(-1)
            target[filler] = torch.arange(target.shape[1])
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(self.action)

    def __exit__(self, *exc) -> None:
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


class RoutingRecorder:
    """What the routers of ``model`` did in a pass over ``batch`` (replayed or live), as its micro-batches run:
    per token position, how many MoE layers chose other experts than the batch's routed experts (``differing``,
    [rows, S]), and with ``keep`` the experts themselves ([rows, S, layers, top_k], -1 where none ran)."""

    def __init__(self, model, batch: Batch, keep: bool = False):
        rows, width = batch["input_ids"].shape
        self.rollout = batch.tensors.get(ROUTED_EXPERTS)
        self.differing = torch.zeros(rows, width, dtype=torch.int32)
        config = model.config         # this stage may hold no MoE layer (DeepSeek-V3's dense first ones)
        self.routed = (torch.full((rows, width, len(moe_layers(config)), config.moe_router_topk), MISSING,
                                  dtype=DTYPE) if keep else None)
        self._last: dict[int, torch.Tensor] = {}
        self._hooks = [router.register_forward_hook(self._hook(layer)) for layer, router in routers(model)]

    def _hook(self, layer: int):
        def keep(module, args, output) -> None:
            routing_map = output[1]              # [tokens, experts] bool, top_k set per token
            self._last[layer] = routing_map.float().topk(module.topk, dim=1).indices.sort(dim=1).values.cpu()
        return keep

    def record(self, tokens: RouterTokens, batch_rows: list[int]) -> None:
        """After a micro-batch's forward: its tokens' experts, the micro-batch's row i being batch row
        ``batch_rows[i]`` (rows past them are padding rows, as are columns past the batch's width)."""
        real = (tokens.rows >= 0) & (tokens.rows < len(batch_rows)) & (tokens.cols < self.differing.shape[1])
        rows = torch.as_tensor(batch_rows, dtype=torch.long)[tokens.rows[real]]
        cols = tokens.cols[real]
        for layer, experts in self._last.items():
            experts = experts[real].to(DTYPE)
            if self.routed is not None:
                self.routed[rows, cols, layer] = experts
            if self.rollout is not None:
                inside = cols < self.rollout.shape[1]
                self.differing[rows[inside], cols[inside]] += differing(
                    experts[inside], self.rollout[rows[inside], cols[inside], layer]).int()
        self._last.clear()

    def result(self, tp_group, cp_group, pp_group) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``differing`` and ``routed`` combined over the model-parallel ranks: tensor-parallel ranks route the same
        tokens (or, with sequence parallelism, disjoint ones), context-parallel ranks disjoint ones, pipeline stages
        disjoint layers (whose differing layers add up)."""
        routed = self.routed.int() if self.routed is not None else None     # gloo reduces no int16
        for group, op in ((tp_group, dist.ReduceOp.MAX), (cp_group, dist.ReduceOp.MAX), (pp_group, dist.ReduceOp.SUM)):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(self.differing, op=op, group=group)
                if routed is not None:
                    dist.all_reduce(routed, op=dist.ReduceOp.MAX, group=group)
        return self.differing, routed.to(DTYPE) if routed is not None else None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
