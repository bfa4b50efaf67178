"""Shims for megatron-core's distributed optimizer over torch.optim.Adam (no TransformerEngine / Apex): its checkpoint
save and load, and the hybrid CPU/GPU optimizer's steps. A bit-exact resume test (tests/e2e/test_checkpoint.py) catches
each of these; a "loss looks fine" test does not. Registered after ``compat``'s (the order they are applied in)."""
from __future__ import annotations

import collections

from rlcore.megatron.patches.registry import shim, with_torch_adam


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
