"""The distributed optimizer's state in megatron-core's ``fully_reshardable`` checkpoint format, built for a save
without megatron-core's gather.

megatron-core builds that format by copying every data-parallel rank's optimizer shard into coalesced buffers and
gathering them on each rank (``get_parameter_state_dp_zero``): on a 125M actor that is ~6.5 s of copies before a byte
is written, even at DP1 (docs/benchmarks.md). The format itself is simple: for each model parameter, its fp32 main
copy and Adam moments shaped like the parameter, under ``optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>`` with
the parameter's own TP/PP sharding. Here each parameter's state is written by the data-parallel rank that holds it,
as views (no copy) where one rank holds all of it; only a parameter split across ranks' shards (at most one per shard
boundary) is sent to the rank holding its first element.

One difference: where the model trains in fp32, megatron-core's "main copy" of a parameter is the parameter itself,
and its format would store those bytes twice (a quarter of an Adam checkpoint). They are left out here, and
``fill_main_params`` puts the model's loaded weights in their place on load; megatron-core's own loader then reads the
rest at any layout.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
MAIN_PARAM = "optimizer.state.param."     # the prefix of a main copy's key, before the model parameter's key


def optimizer_sharded_state(optimizer, model_sharded: dict) -> dict:
    """What ``optimizer.sharded_state_dict(model_sharded, metadata={"distrib_optim_sharding_type":
    "fully_reshardable"})`` returns on save, keys and structure alike, for a (chained) distributed optimizer."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding, extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded)
    by_param = {sh.data: sh for sh in nested_values(tensors)}
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) == 1:
        return _one_optimizer(chained[0], by_param)
    optimizer._synchronize_steps()
    out = {}
    for index, inner in enumerate(chained):
        out[index] = _one_optimizer(inner, by_param)
        add_prefix_for_sharding(out[index], f"chained_{index}.")   # as megatron-core's ChainedOptimizer names them
    return out


def saved_by_one_optimizer(optimizer, saved_keys) -> bool:
    """Whether a checkpoint (``saved_keys``: its tensor keys) holds one optimizer's state where ``optimizer`` chains
    several (keys then have no ``chained_<i>.`` prefix): a MoE model's from before its experts had their own optimizer
    at every layout (``rlcore.megatron.model.mark_expert_parameters``; until then only under EP > 1)."""
    return (len(getattr(optimizer, "chained_optimizers", [])) > 1
            and not any(key.startswith("chained_") for key in saved_keys))


def chained_from_one(optimizer, loaded: dict) -> dict:
    """One optimizer's loaded state (its param groups and settings) with each chained optimizer's per-parameter state
    (loaded under ``loaded[index]``, the request made without the chained prefix) -> the chained optimizer's
    ``load_state_dict`` input. The one optimizer's param groups were all dense: an expert optimizer's are the same
    groups (learning rate, weight decay, step) flagged expert-parallel, as megatron-core matches them by that flag."""
    shared = {key: value for key, value in loaded.items() if not isinstance(key, int)}
    out = {}
    for index, inner in enumerate(optimizer.chained_optimizers):
        expert = any(group.get("is_expert_parallel", False) for group in inner.optimizer.param_groups)
        groups = [{**group, "is_expert_parallel": expert} for group in shared["optimizer"]["param_groups"]]
        out[index] = {**shared, **loaded[index], "optimizer": {**shared["optimizer"], "param_groups": groups}}
    return out


def _one_optimizer(dist_opt, by_param: dict) -> dict:
    state = dist_opt.state_dict()   # param groups, step, grad scaler: everything but the per-parameter tensors
    state["param_state"] = _param_state(dist_opt, by_param)
    state["param_state_sharding_type"] = "fully_reshardable"
    return state


def _pieces(buffer, start: int, end: int, bucket_id: int, dp_size: int) -> list[tuple[int, int, int]]:
    """(data-parallel rank, first, last element) of each rank's part of the parameter at [start, end) of
    ``buffer``: each rank holds the same-sized contiguous slice of every bucket (megatron-core's
    ``_build_model_gbuf_range``)."""
    bucket = buffer.buckets[bucket_id]
    size = bucket.grad_data.numel() // dp_size
    pieces = []
    for rank in range(dp_size):
        lo, hi = max(start, bucket.offset + rank * size), min(end, bucket.offset + (rank + 1) * size)
        if lo < hi:
            pieces.append((rank, lo - start, hi - start))
    return pieces


def _param_state(dist_opt, by_param: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    group = dist_opt.data_parallel_group_gloo
    dp_rank, dp_size = group.rank(), group.size()
    state = {}
    # numbered across buffers as megatron-core numbers them
    params = ((b, param, where) for b in dist_opt.buffers for param, where in b.param_index_map.items())
    for index, (buffer, param, (start, end, bucket_id)) in enumerate(params):
        pieces = _pieces(buffer, start, end, bucket_id, dp_size)
        owner = pieces[0][0]
        if dp_rank not in [rank for rank, _, _ in pieces]:
            continue
        local = dist_opt._get_main_param_and_optimizer_states(param)
        keys = [k for k in STATE_KEYS if k != "param" or not _same_storage(local["param"], param)]
        held = {key: local[key] if key in local else torch.zeros_like(local["param"]) for key in keys}
        mine = _gather_to_owner(held, pieces, owner, dp_rank, param.numel(), group) if len(pieces) > 1 else held
        if mine is None:
            continue
        meta = by_param[param]
        # the owner is this state's only writer: main replica along data parallelism
        replica_id = (*meta.replica_id[:-1], 0) if isinstance(meta.replica_id, tuple) else 0
        entry = {}
        for key, flat in mine.items():
            data = flat.float().view(meta.data.shape)
            kwargs = dict(key=f"optimizer.state.{key}.{meta.key}", data=data, dtype=data.dtype,
                          replica_id=replica_id)
            if isinstance(meta, ShardedTensorFactory):   # no dtype of its own
                kwargs.pop("dtype")
            entry[key] = replace(meta, **kwargs)
            entry[key].validate_metadata_integrity()
        state[index] = entry
    return state


def _same_storage(main: torch.Tensor, param: torch.Tensor) -> bool:
    return main.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


def _gather_to_owner(mine: dict, pieces: list, owner: int, dp_rank: int, numel: int, group) -> dict | None:
    """A parameter whose state is split across data-parallel ranks, whole on ``owner`` (None elsewhere)."""
    if dp_rank != owner:
        for key in mine:
            dist.send(mine[key].float().contiguous(), dist.get_global_rank(group, owner), group=group)
        return None
    whole = {}
    for key in mine:
        whole[key] = torch.empty(numel, dtype=torch.float32)
        for rank, lo, hi in pieces:
            if rank == owner:
                whole[key][lo:hi] = mine[key]
            else:
                dist.recv(whole[key][lo:hi], dist.get_global_rank(group, rank), group=group)
    return whole


def without_absent_main_params(request: dict, saved_keys) -> list:
    """Take out of an optimizer load ``request`` (megatron-core's fully_reshardable, ``is_loading=True``) the main
    copies a checkpoint does not hold (``saved_keys``: its tensor keys); returns where they were, for
    ``fill_main_params``."""
    taken = []

    def walk(tree):
        for name, value in list(tree.items()) if isinstance(tree, dict) else []:
            key = getattr(value, "key", None)
            if isinstance(key, str) and MAIN_PARAM in key and key not in saved_keys:
                taken.append((tree, name, key.split(MAIN_PARAM, 1)[1]))
                del tree[name]
            else:
                walk(value)
    walk(request)
    return taken


def fill_main_params(taken: list, model_request: dict, model_loaded: dict) -> None:
    """Put the model's loaded weights where ``without_absent_main_params`` took main copies out."""
    by_key = {sharded.key: model_loaded[name] for name, sharded in model_request.items() if hasattr(sharded, "key")}
    for tree, name, model_key in taken:
        tree[name] = by_key[model_key]
