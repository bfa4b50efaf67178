"""A trained Megatron model's weights and optimizer state through megatron-core's distributed checkpointing (the
torch_dist format: each rank writes its shards; a load at another TP/PP/DP layout reshards), and each rank's random
number generator states as JSON. Nothing here is unpickled on load except megatron-core's own ``common.pt`` metadata,
read with ``weights_only=True``."""
from __future__ import annotations

import base64
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from rlcore.megatron.optimizer_state import (chained_from_one, fill_main_params, optimizer_sharded_state,
                                            saved_by_one_optimizer, without_absent_main_params)

# The distributed optimizer's state is saved per model parameter, in megatron-core's "fully_reshardable" layout, so
# that a resume may change TP/PP/DP: built by rlcore.megatron.optimizer_state on save, read by megatron-core on load
# (gloo-capable, "mem_efficient", as CPU ranks need). Its per-rank "dp_reshardable" layout was no faster to save
# once the gather was gone (docs/benchmarks.md); megatron-core 0.16.1's default, "fully_sharded_model_space", no
# longer saves.
LOAD_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                 "distrib_optim_fully_reshardable_mem_efficient": True}


def _metadata() -> dict:
    from megatron.core import parallel_state as mpu

    return {**LOAD_METADATA, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}


def model_entries(model, metadata: dict) -> dict:
    """The model's checkpoint entries. With LoRA adapters only theirs: the frozen base weights are the HF checkpoint
    the run started from (the controller records which and checks it on resume), so a LoRA checkpoint is
    adapter-sized and a resume reads the base from where the run reads it anyway."""
    from rlcore.lora.layers import adapters
    from rlcore.megatron.names import is_adapter_parameter

    entries = model.sharded_state_dict(metadata=metadata)
    if next(adapters(model), None) is None:
        return entries
    return {name: entry for name, entry in entries.items() if is_adapter_parameter(name)}


def _load_into(model, loaded: dict) -> None:
    """Put loaded entries into ``model``: all of them, or with LoRA all of the adapters' (nothing else was saved)."""
    from rlcore.megatron.names import is_adapter_parameter

    missing, unexpected = model.load_state_dict(loaded, strict=False)
    adapter_only = all(is_adapter_parameter(name) for name in loaded)
    missing = [name for name in missing if not adapter_only or is_adapter_parameter(name)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint entries do not match the model: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}")


def _sharded_state(trainable, loading: bool, with_optimizer: bool = True, chained_prefix: bool = True) -> dict:
    """``chained_prefix`` False: a chained optimizer's entries requested under one optimizer's keys (a checkpoint
    saved with one optimizer, ``saved_by_one_optimizer``)."""
    metadata = _metadata()
    model = model_entries(trainable.model, metadata)
    if not with_optimizer:
        return {"model": model}
    if not loading:
        return {"model": model, "optimizer": optimizer_sharded_state(trainable.optimizer, model)}
    return {"model": model, "optimizer": trainable.optimizer.sharded_state_dict(
        model, is_loading=True, metadata={**metadata, "chained_optim_avoid_prefix": not chained_prefix})}


def optimizer_has_state(trainable) -> bool:
    """Whether the optimizer has taken a step (torch's Adam creates its moments then; before, there is nothing to
    save, and megatron-core cannot save it: a PPO actor waiting for the critic's warm-up)."""
    inner = [o.optimizer for o in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])]
    return any(len(o.state) for o in inner)


def save_model(trainable, directory: str, pending=None) -> bool:
    """Collective: every rank of the model's world writes its shards into ``directory``; the optimizer's only once it
    has state. Returns whether it was saved (``load_model``'s ``with_optimizer``).

    With ``pending`` (megatron-core's ``AsyncCallsQueue``) the bytes are written by a forked process while training
    goes on: the fork is the snapshot (host tensors are copy-on-write; megatron-core copies device tensors to the
    host before it forks), and the checkpoint is complete only once ``pending.maybe_finalize_async_calls`` has
    finalized it on every rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    with_optimizer = optimizer_has_state(trainable)
    request = dist_checkpointing.save(_sharded_state(trainable, False, with_optimizer), directory,
                                      sharded_strategy=get_default_save_sharded_strategy("torch_dist"),
                                      validate_access_integrity=True, async_sharded_save=pending is not None)
    if pending is not None:
        pending.schedule_async_request(request)
    return with_optimizer


def save_weights(model, directory: str) -> None:
    """Collective: the model's weights alone, as ``save_model`` writes them (``rlcore convert``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(metadata=_metadata())}, directory,
                            sharded_strategy=get_default_save_sharded_strategy("torch_dist"),
                            validate_access_integrity=True)


def load_weights(model, directory: str) -> None:
    """Collective: the weights ``save_model`` or ``save_weights`` wrote, into ``model`` at this process group's
    layout (each rank reads its shard)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    loaded = dist_checkpointing.load({"model": model_entries(model, _metadata())}, directory,
                                     sharded_strategy=get_default_load_sharded_strategy(directory),
                                     validate_access_integrity=True)
    _load_into(model, loaded["model"])


def load_model(trainable, directory: str, with_optimizer: bool = True) -> None:
    """Collective: the weights (and optimizer state) saved by ``save_model``, at this process group's layout."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    if not with_optimizer:
        load_weights(trainable.model, directory)
        return
    saved_keys = dist_checkpointing.load_tensors_metadata(directory).keys()
    by_one = saved_by_one_optimizer(trainable.optimizer, saved_keys)
    request = _sharded_state(trainable, True, chained_prefix=not by_one)
    model_request = dict(request["model"])       # the load replaces the request's entries with tensors
    taken = without_absent_main_params(request["optimizer"], saved_keys)
    loaded = dist_checkpointing.load(request, directory, sharded_strategy=get_default_load_sharded_strategy(directory),
                                     validate_access_integrity=True)
    _load_into(trainable.model, loaded["model"])
    fill_main_params(taken, model_request, loaded["model"])
    state = chained_from_one(trainable.optimizer, loaded["optimizer"]) if by_one else loaded["optimizer"]
    # fp32 main params are views of the model's leaf parameters: copying into them must not be recorded
    with torch.no_grad():
        trainable.optimizer.load_state_dict(state)


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's generators (torch, Python, NumPy, and Megatron's model-parallel tracker) as JSON-able data."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)   # type: ignore[misc]
    version, internal, python_gauss = random.getstate()
    return {"torch": _encode(torch.get_rng_state()),
            "python": [version, list(internal), python_gauss],
            "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss],
            "tracker": {name: _encode(state) for name, state in get_cuda_rng_tracker().get_states().items()}}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(_decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, numpy_gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, numpy_gauss))
    tracker = get_cuda_rng_tracker()
    tracker.set_states({**tracker.get_states(), **{k: _decode(v) for k, v in state["tracker"].items()}})


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_regions(directory: str, regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
    """Fill each tensor of ``regions`` (checkpoint key -> [(global offset, destination tensor)]) with that region of
    the key's global tensor in ``directory`` (megatron-core's torch_dist format), reading only the stored chunks that
    overlap it; in this process alone, with no process group. megatron-core's own load cannot read part of a
    tensor in a world of one (it marks the rest of the tensor as this rank's too), which an export of a model larger
    than memory needs: one layer's weights at a time."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Regions(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            assert self.metadata is not None, "the checkpoint's metadata is read before the plan"
            items = []
            for key, parts in regions.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in parts]
                stored = self.metadata.state_dict_metadata[key]
                assert isinstance(stored, TensorStorageMetadata), f"{key} is not a tensor in {directory}"
                items += create_read_items_for_chunk_list(key, stored, chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            target = regions[read_item.dest_index.fqn][read_item.dest_index.index][1]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, start, length)
            return target

    dcp_load({}, storage_reader=FileSystemReader(directory), planner=Regions(), no_dist=True)
