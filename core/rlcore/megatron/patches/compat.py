"""Shims for gaps in megatron-core that are not about CPU: they apply on GPUs too, whenever the condition they are
registered with holds (TransformerEngine missing; the distributed optimizer over torch's Adam). Context parallelism
without TransformerEngine lives in the attention module the layer specs use (rlcore.megatron.attention)."""
from __future__ import annotations

import collections

from rlcore.megatron.patches.registry import shim, with_torch_adam, without_transformer_engine


@shim("moe")
def define_te_general_gemm_without_transformer_engine() -> None:
    """moe_utils imports ``te_general_gemm`` only when TransformerEngine is installed, yet the MoE router's gating
    function tests ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError. Define it as None so the router takes its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@shim("tp2-sp", when=without_transformer_engine)
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


@shim("mla", when=without_transformer_engine)
def multi_latent_attention_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MLA module sets ``HAVE_TE`` when its TE extension imports, which it does without TE
    (as mock classes); MLA's constructor then calls ``isinstance(linear_proj, <mock>)`` and raises TypeError."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


@shim("mla-tp2-sp")
def multi_latent_attention_reduces_the_positional_key_gradient() -> None:
    """megatron-core 0.16.1's MLA with a column-parallel ``linear_kv_down_proj`` (its local spec) gathers that
    projection's output over TP and splits off the positional key, which each TP rank expands over its own heads
    only; the gather's backward keeps each rank's own slice, so the positional rows' gradient is the sum over one
    rank's heads, never reduced over TP (NVIDIA/Megatron-LM#1699, open): at TP > 1 the down projection's gradient and
    every gradient before it are wrong (a DeepSeek-V3 LoRA update at TP2 differed from TP1 by 3 %). A forward hook
    gathers the output itself, so the attention takes the path it takes for a replicated (duplicated) projection:
    with sequence parallelism the output is cut back to this rank's sequence chunk and the attention gathers the
    positional key over the sequence, whose backward reduce-scatters (sums) its gradient; without, the positional
    columns pass a TP region that all-reduces their gradient. The forward values are unchanged."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if getattr(MLASelfAttention, "_rlcore_positional_key", False):
        return
    original = MLASelfAttention.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        down = self.linear_kv_down_proj
        if isinstance(down, ColumnParallelLinear) and down.tp_group is not None and down.tp_group.size() > 1:
            down.register_forward_hook(_kv_down_output_whole(self.config.qk_pos_emb_head_dim, down.tp_group,
                                                             self.config.sequence_parallel))

    MLASelfAttention.__init__ = __init__
    MLASelfAttention._rlcore_positional_key = True


def _kv_down_output_whole(positional: int, group, sequence_parallel: bool):
    """The forward hook of ``multi_latent_attention_reduces_the_positional_key_gradient``."""
    import torch
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)

    def hook(module, args, output):
        out, bias = output
        whole = gather_from_tensor_model_parallel_region(out, group=group)
        if sequence_parallel:
            return scatter_to_sequence_parallel_region(whole, group=group), bias
        compressed, key = whole.split([whole.shape[-1] - positional, positional], dim=-1)
        return torch.cat([compressed, copy_to_tensor_model_parallel_region(key, group=group)], dim=-1), bias

    return hook


@shim("checkpoint")
def checkpoint_writes_without_a_spawned_manager() -> None:
    """The first checkpoint save starts a ``multiprocessing`` Manager through the *spawn* context to carry write
    results back from the writer processes; spawn re-imports ``__main__``, so a save from any script without an
    ``if __name__ == "__main__"`` guard (a user's, a Ray worker's) dies with EOFError, and starting it costs seconds.
    The writers are forked (megatron-core's non-persistent async caller and the synchronous save's workers), so a
    Manager forked from this process serves them, in milliseconds. (A plain pipe-backed queue does not: a put from
    this process reaches the pipe only later, through a feeder thread, and a forked writer's put of more than a pipe
    buffer of results would block its exit until read.) The forked Manager exits with this process: it holds a copy
    of every descriptor this process had, Ray's connection to a worker among them, and outliving a killed worker it
    would hide the worker's death from Ray (the run would wait on the dead worker forever).

    Each save gets a queue of its own (megatron-core hands every save the one process-wide queue): a finished save
    takes the first result in its queue as its own, so two saves in flight in one process (a world-of-one run's
    actor and critic, saved together) could each take the other's write results and record the other's file
    offsets in their metadata: a checkpoint that reads back garbage (seen: kill-and-resume of PPO under load)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async._get_write_results_queue, "_rlcore", False):
        return
    managers: list[SyncManager] = []

    def forked_manager_queue():
        if not managers:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=exit_with_parent)
            managers.append(manager)
        return managers[0].Queue()

    forked_manager_queue._rlcore = True  # type: ignore[attr-defined]
    filesystem_async._get_write_results_queue = forked_manager_queue


def exit_with_parent() -> None:
    """In a forked helper process: exit as soon as the process that forked it is gone (its parent changes)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="rlcore-exit-with-parent", daemon=True).start()


# what torch.distributed.checkpoint's `.metadata` pickle may name: its own metadata classes and torch's type names
_CHECKPOINT_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool"},
    "collections": {"OrderedDict"},
}


@shim("crafted-checkpoint")
def checkpoint_loading_never_unpickles_code() -> None:
    """torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with ``pickle.load`` and its non-tensor items
    with ``torch.load(weights_only=False)``: a crafted checkpoint runs code when loaded. Read the metadata with an
    unpickler that knows only the metadata classes, and the items with ``weights_only=True`` (rlcore's are None:
    the layers' empty ``_extra_state``). megatron-core's ``common.pt`` is read with torch's default, weights only."""
    import io
    import pickle
    import types

    import torch
    from torch.distributed.checkpoint import default_planner, filesystem

    if getattr(filesystem.pickle, "_rlcore", False):
        return

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if name not in _CHECKPOINT_METADATA_GLOBALS.get(module, ()):
                raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not checkpoint "
                                             f"metadata: refused (a checkpoint never loads code)")
            return super().find_class(module, name)

    filesystem.pickle = types.SimpleNamespace(  # type: ignore[assignment]
        dump=pickle.dump, dumps=pickle.dumps, load=lambda f: MetadataUnpickler(f).load(),
        loads=lambda data: MetadataUnpickler(io.BytesIO(data)).load(), _rlcore=True)

    class TensorsOnlyTorch:
        """``torch`` as the load planner sees it: ``torch.load`` reads tensors and plain data only."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def load(f, *args, **kwargs):
            return torch.load(f, *args, **{**kwargs, "weights_only": True})

    default_planner.torch = TensorsOnlyTorch()  # type: ignore[assignment]


# --- the distributed optimizer over torch.optim.Adam (no TransformerEngine / Apex): checkpoint save and load --------
# A bit-exact resume test (tests/test_checkpoint.py) catches each of these; a "loss looks fine" test does not.

@shim("checkpoint", when=with_torch_adam)
def optimizer_state_dict_before_the_first_step() -> None:
    """``DistributedOptimizer.state_dict()`` reads the step from the per-parameter Adam states (``assert len(steps)
    == 1``), which a never-stepped optimizer does not have: loading a checkpoint into a fresh optimizer (a resume)
    asserts. Report step 0 there, as the TE/Apex path does; the load then restores the checkpoint's step."""
    from megatron.core.optimizer import distrib_optimizer as D

    original = D.DistributedOptimizer.state_dict
    if getattr(original, "_rlcore", False):
        return

    def state_dict(self):
        if len(self.optimizer.state) > 0:
            return original(self)
        inner = self.optimizer.state_dict()
        result = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in result["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    state_dict._rlcore = True  # type: ignore[attr-defined]
    D.DistributedOptimizer.state_dict = state_dict


@shim("checkpoint", when=with_torch_adam)
def adam_step_not_copied_from_loaded_state() -> None:
    """Loading copies every key of each parameter's optimizer state from the checkpoint's tensors; torch's Adam keeps
    a per-parameter ``step`` that the loaded tensors lack (``fully_reshardable``: KeyError 'step'). The step is
    restored from the param groups instead; copy the tensors given, never ``step``."""
    from megatron.core.optimizer import distrib_optimizer as D

    original = D.DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_rlcore", False):
        return

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        states = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            if key in states and key != "step":
                states[key].copy_(value)

    set_states._rlcore = True  # type: ignore[attr-defined]
    D.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


@shim("checkpoint", when=with_torch_adam)
def adam_step_tensor_per_parameter_after_load() -> None:
    """``DistributedOptimizer.load_state_dict`` gives every parameter's state the same ``step`` tensor; torch's Adam
    increments it in place once per parameter, so after a resume the step races ahead (2 -> 40 in two updates) and
    the bias correction, hence every update, is wrong. Give each state its own step tensor."""
    import torch
    from megatron.core.optimizer import distrib_optimizer as D

    original = D.DistributedOptimizer.load_state_dict
    if getattr(original, "_rlcore", False):
        return

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        seen: set[int] = set()
        for state in self.optimizer.state.values():
            step = state.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    state["step"] = step = step.clone()
                seen.add(id(step))

    load_state_dict._rlcore = True  # type: ignore[attr-defined]
    D.DistributedOptimizer.load_state_dict = load_state_dict


# --- the hybrid CPU/GPU optimizer (optimizer_cpu_offload, rlcore_plugins' hybrid_adam) ------------------------------

@shim("hybrid")
def hybrid_optimizer_takes_fp32_shards() -> None:
    """The distributed optimizer shards an fp32 parameter (every parameter of an fp32 model; the torch norms of a
    bf16 one) as a view ``model_param.view(-1)[a:b]``, which is not a leaf. The plain optimizer is handed its param
    groups by assignment, but the hybrid one is built anew from them, and ``torch.optim.Optimizer`` refuses them
    ("can't optimize a non-leaf Tensor"). Hand it detached views instead: the same storage, so its updates still
    land in the model's parameters, as the plain optimizer's do."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import distrib_optimizer as D

    original = D.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__
    if getattr(original, "_rlcore", False):
        return

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if not config.optimizer_cpu_offload:
            return groups
        model_fp32_groups, shard_fp32_groups = groups[1], groups[3]
        leaves = {}
        for model_group, shard_group in zip(model_fp32_groups, shard_fp32_groups):
            for i, (model_param, shard) in enumerate(zip(model_group, shard_group)):
                if not shard.is_leaf:
                    leaf = shard.detach()
                    tensor_parallel.copy_tensor_model_parallel_attributes(leaf, model_param)
                    if hasattr(shard, "shared"):
                        leaf.shared = shard.shared
                    leaves[id(shard)] = shard_group[i] = leaf
        for group_range in opt_group_ranges:
            group_range["orig_group"]["params"] = [leaves.get(id(p), p) for p in group_range["orig_group"]["params"]]
        return groups

    build._rlcore = True  # type: ignore[attr-defined]
    D.DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)


@shim("hybrid", when=with_torch_adam)
def hybrid_optimizer_steps_like_the_plain_one() -> None:
    """megatron-core builds the hybrid optimizer's sub-optimizers (torch's AdamW here) with ``fused=True``, while the
    plain distributed optimizer's torch AdamW is unfused: the two kernels round differently (fp32 master weights
    apart by ~2e-8 after five steps; at TP2 the losses by 2e-5 from the third). Build them unfused, so that moving
    optimizer state to the host changes no update; the host step is then slower (50M fp32 elements, one thread:
    0.108 s instead of 0.034 s). With TE or Apex the plain optimizer is their fused Adam, and this does not apply."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H

    if getattr(H.HybridDeviceOptimizer, "_rlcore_unfused", False):
        return
    original = H.HybridDeviceOptimizer.__init__

    def __init__(self, params, *args, **kwargs):
        original(self, params, *args, **{**kwargs, "fused": False})

    H.HybridDeviceOptimizer.__init__ = __init__  # type: ignore[method-assign]
    H.HybridDeviceOptimizer._rlcore_unfused = True  # type: ignore[attr-defined]


@shim("hybrid")
def hybrid_optimizer_param_groups_hold_data_only() -> None:
    """The hybrid optimizer's defaults, which torch copies into every param group, include its sub-optimizer
    classes; a checkpoint stores the param groups in megatron-core's ``common.pt``, which is read back with
    ``weights_only=True`` and refuses them ("Unsupported global: torch.optim.adamw.AdamW"). It reads the classes
    from its attributes, never from the groups: leave them out of the groups."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H

    if getattr(H.HybridDeviceOptimizer, "_rlcore_data_groups", False):
        return
    original = H.HybridDeviceOptimizer.__init__

    def __init__(self, params, *args, **kwargs):
        original(self, params, *args, **kwargs)
        for group in self.param_groups:
            group.pop("cpu_optimizer_cls", None)
            group.pop("gpu_optimizer_cls", None)

    H.HybridDeviceOptimizer.__init__ = __init__  # type: ignore[method-assign]
    H.HybridDeviceOptimizer._rlcore_data_groups = True  # type: ignore[attr-defined]


@shim("hybrid")
def hybrid_optimizer_state_after_a_load() -> None:
    """After the distributed optimizer loads state into the hybrid one, ``_sync_hdo_state_to_sub_optimizers`` hands
    each sub-optimizer its parameters' state. It looks every parameter up among the fp32 copies it made of bf16 ones
    (``KeyError``: the distributed optimizer hands it fp32 main params only, so it made none), and moves the device
    sub-optimizer's state ``.to("cuda")``. Hand over the state as it does, leave each tensor on its parameter's
    device, and give each host copy the loaded main param's value (megatron-core copies it only into the main param;
    the next step would start from the host copy's old value)."""
    import torch
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H

    if getattr(H.HybridDeviceOptimizer, "_rlcore_load", False):
        return

    def _sync_hdo_state_to_sub_optimizers(self):
        for optimizer in self.sub_optimizers:
            new_state: dict = {}
            for group in optimizer.param_groups:
                for param in group["params"]:
                    orig_param = self.inner_param_to_orig_param[param]
                    state = self.state[orig_param]
                    if param is not orig_param:
                        param.data.copy_(orig_param.data)
                    for key, value in list(state.items()):
                        if key == "master_param":
                            state[key] = param
                        elif torch.is_tensor(value) and key != "step":
                            state[key] = value.to(param.device)
                    new_state[param] = state
            optimizer.state = collections.defaultdict(dict, new_state)

    H.HybridDeviceOptimizer._sync_hdo_state_to_sub_optimizers = _sync_hdo_state_to_sub_optimizers
    H.HybridDeviceOptimizer._rlcore_load = True  # type: ignore[attr-defined]
