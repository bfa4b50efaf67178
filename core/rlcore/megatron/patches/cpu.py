"""Shims that let megatron-core run on CPU with gloo (registered with ``cpu_only=True``: never applied where CUDA is
available).

megatron-core assumes CUDA in a few dozen places (RNG tracker, buffers allocated with device="cuda", streams,
``param.type() == 'torch.cuda.FloatTensor'`` checks). Each shim below works around one such assumption and names the
modules it touches; ``shim``'s first argument names the smallest case that fails without it: dense, moe, moe-ep2, cp2,
checkpoint, hybrid.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch

from rlcore.megatron.patches.registry import shim


# --- a per-module stand-in for `torch` that maps CUDA devices to the CPU ------------------------------------------

def _to_cpu_device(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NoOpEvent:
    def __init__(self, *a, **k): ...
    def record(self, *a, **k): ...
    def wait(self, *a, **k): ...
    def synchronize(self): ...
    def query(self): return True


class _NoOpStream(_NoOpEvent):
    def record_event(self, *a, **k): return _NoOpEvent()
    def wait_stream(self, *a, **k): ...
    def wait_event(self, *a, **k): ...


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by a shimmed module: the current device is the CPU; streams and events do nothing."""

    def __init__(self):
        super().__init__("rlcore_cpu_cuda")
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *a, **k: None
        self.is_available = lambda: False
        self.Event, self.Stream = _NoOpEvent, _NoOpStream
        self.current_stream = self.default_stream = lambda *a, **k: _NoOpStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                          range=lambda *a, **k: contextlib.nullcontext())
        self.memory_allocated = self.max_memory_allocated = lambda *a, **k: 0
        self.empty_cache = lambda: None
        self.device_count = lambda: 0

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "empty_strided",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace")


class _CpuTorch(types.ModuleType):
    """`torch` as seen by a shimmed module: tensor factories put "cuda" tensors on the CPU, unpinned."""

    def __init__(self):
        super().__init__("rlcore_cpu_torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    @staticmethod
    def _on_cpu(factory):
        def make(*args, device=None, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, device=_to_cpu_device(device), **kwargs)
        return make

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_torch_in(*module_names: str) -> None:
    for name in module_names:
        setattr(importlib.import_module(name), "torch", _CpuTorch())


# --- the shims ------------------------------------------------------------------------------------------------------

@shim("dense", cpu_only=True)
def rng_tracker_on_cpu_generator():
    """`model_parallel_cuda_manual_seed` and every `get_cuda_rng_tracker().fork()` (weight init, dropout in TP regions)
    read and write the CUDA generator. Keep the tracker's named states on the CPU generator, same seeding semantics."""
    from megatron.core.tensor_parallel import random as R

    R._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    R._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name!r} / seed {seed} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name=R._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name!r} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    R.CudaRNGStatesTracker.add = add
    R.CudaRNGStatesTracker.fork = fork


@shim("dense", cpu_only=True)
def cuda_allocations_on_cpu():
    """Buffers that megatron-core allocates with device="cuda" / torch.cuda.current_device(): the schedules' token
    counter, RoPE inv_freq (plain, and YaRN's as multi-latent attention uses it), the global memory buffer, the
    default causal mask, pipeline p2p receive buffers, TP mapping buffers and GPU-path weight init, the DDP
    param/grad buffers and the optimizer's found-inf / norm tensors."""
    _cpu_torch_in(
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "megatron.core.utils",
        "megatron.core.transformer.utils",
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.distributed.distributed_data_parallel",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.finalize_model_grads",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.optimizer.grad_scaler",
    )


@shim("dense", cpu_only=True)
def cuda_tensor_type_strings():
    """The optimizers and grad clipping accept only params whose `type()` is 'torch.cuda.FloatTensor' (or the
    bf16/fp16 names). In a process without CUDA, report a CPU tensor's type with the CUDA name; `type(dtype)` with an
    argument is unchanged. Process-wide, which is safe only because no CUDA tensor can exist in such a process."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


@shim("moe", cpu_only=True)
def moe_streams_and_buffers_on_cpu():
    """The MoE token dispatcher creates a torch.cuda.Stream for device-to-host copies of token counts and records
    CUDA events; the router, experts and helpers allocate with device="cuda"."""
    _cpu_torch_in(
        "megatron.core.transformer.moe.token_dispatcher",
        "megatron.core.transformer.moe.moe_utils",
        "megatron.core.transformer.moe.router",
        "megatron.core.transformer.moe.experts",
        "megatron.core.transformer.moe.moe_layer",
    )


@shim("moe-ep2", cpu_only=True)
def moe_split_sizes_as_numpy():
    """``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts the all-to-all split sizes to numpy only for CUDA
    tensors; on CPU they stay tensors and ``all_to_all_single`` rejects them. Honour ``as_numpy`` for CPU too."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            return tensor.numpy() if as_numpy else tensor
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


@shim("cp2", cpu_only=True)
def rope_context_parallel_index_on_cpu():
    """RoPE under context parallelism picks this rank's chunks with an index tensor built as
    ``torch.tensor(..., pin_memory=True).cuda()``; build it on the embedding's own device."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


@shim("checkpoint", cpu_only=True)
def checkpoint_writer_without_cuda_sync():
    """Distributed checkpointing's file writer (the synchronous save runs the async request inline) calls
    ``torch.cuda.synchronize()`` before copying tensors out."""
    _cpu_torch_in("megatron.core.dist_checkpointing.strategies.filesystem_async")


@shim("checkpoint", cpu_only=True)
def checkpoint_async_writes_on_cpu():
    """An asynchronous save calls ``torch.cuda.synchronize()`` before it forks its writer, and all-reduces its
    completion flags built on ``torch.cuda.current_device()``."""
    _cpu_torch_in("megatron.core.dist_checkpointing.strategies.async_utils")


@shim("checkpoint", cpu_only=True)
def checkpoint_saver_flags_on_cpu():
    """The save's cached-plan check and node-failure check all-reduce flags built with ``device='cuda'``."""
    _cpu_torch_in("megatron.core.dist_checkpointing.strategies.state_dict_saver")


@shim("hybrid", cpu_only=True)
def hybrid_optimizer_streams_on_cpu():
    """The hybrid CPU/GPU optimizer (``actor.optim.name=hybrid_adam``) copies gradients down and parameters back on
    ``torch.cuda`` streams and events, and allocates its host gradients with ``pin_memory=True``."""
    _cpu_torch_in("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")


@shim("hybrid", cpu_only=True)
def hybrid_optimizer_splits_host_parameters():
    """The hybrid optimizer decides what to offload by ``param.is_cuda``: in a CPU process no parameter is a device
    one, the offload threshold is 0 and every parameter goes to a host sub-optimizer with no host copy of its own
    (then ``KeyError`` in ``_set_sub_optimizer_grads``); it also pins the copies unconditionally. Split as on a GPU,
    every parameter counting as a device one, so the offload fraction, host copies, gradient copies and copy-back
    hooks run exactly as they do there (megatron-core's method, with those two differences)."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        params = [p for group in self.param_groups for p in group["params"]]
        offload_threshold = sum(p.numel() for p in params) * offload_fraction
        offload_params_numel = 0
        cpu_param_groups, gpu_param_groups = [], []
        gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, param_to_fp32_param = {}, {}, {}
        for group in self.param_groups:
            gpu_group, cpu_group = group.copy(), group.copy()
            gpu_group["params"], cpu_group["params"] = [], []
            for param in group["params"]:
                orig_param, cpu_copy = param, False
                if offload_params_numel < offload_threshold:
                    param = param.detach().clone()          # on a GPU: .clone().cpu().pin_memory()
                    offload_params_numel += param.numel()
                    cpu_copy = True
                if self.param_update_in_fp32 and param.dtype != torch.float32:
                    param = param.detach().clone().float()
                    param_to_fp32_param[orig_param] = param
                if cpu_copy:
                    gpu_params_map_cpu_copy[orig_param] = param
                    cpu_copys_map_gpu_param[param] = orig_param
                    cpu_group["params"].append(param)
                else:
                    gpu_group["params"].append(param)
            if gpu_group["params"]:
                gpu_param_groups.append(gpu_group)
            if cpu_group["params"]:
                cpu_param_groups.append(cpu_group)
        return cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy, cpu_copys_map_gpu_param, \
            param_to_fp32_param

    H.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups
