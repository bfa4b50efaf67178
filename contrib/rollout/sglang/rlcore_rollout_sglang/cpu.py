"""The shims that let SGLang (pinned: 0.5.23) run on a CPU from PyPI packages alone, next to vLLM's CPU build.

``rlcore_rollout_sglang.pth`` (shipped at the top of site-packages) runs ``rlcore_rollout_sglang.startup`` at every
interpreter start, which puts an import hook first on ``sys.meta_path`` that calls the first four functions below
when the module they concern is first imported, so SGLang's spawned scheduler and detokenizer processes get them too;
``bind_threads`` runs before an engine with more than one TP rank starts. Each names what
it works around; ``tests/test_sglang_cpu_shims.py`` shows each is still needed, so a shim that a later SGLang (or
torchvision) no longer needs shows up as a failing test. One more workaround is not code: ``requirements-sglang.txt``
installs SGLang with ``--no-deps`` and pins what it imports, because its declared dependencies pin a CUDA torch and
CUDA-only kernel packages.
"""
from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import importlib.util
import mmap
import os
import sys
from types import ModuleType
from typing import Any, Callable

from rlcore_rollout_sglang.startup import ENV

SHIMS = ("torchvision_op_schemas", "sgl_kernel_stand_in", "shared_expert_gate_in_torch", "host_buffers_unpinned")
_keep: list[Any] = []    # the torch.library registration must stay alive


def torchvision_op_schemas() -> bool:
    """Works around: PyPI's torchvision (0.28.0) is built for CUDA, so under the CPU torch its C extension cannot load
    and its ops are never defined; two of its meta-kernel registrations (``register_fake("torchvision::nms")`` and
    ``"torchvision::qnms"``) are not guarded on the extension having loaded and raise ``operator torchvision::nms does
    not exist`` at ``import torchvision``. SGLang's config package imports ``torchvision.transforms`` (pure Python),
    and transformers imports torchvision wherever it is installed (its model classes then fail to import). Defines
    those two op schemas (no kernels: calling the ops still fails) before torchvision is first imported, only when
    torchvision's extension is a CUDA build and torch is not. Returns whether it defined them."""
    if not cuda_built_torchvision_on_cpu_torch():
        return False
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:    # already defined
            pass
    _keep.append(lib)
    return True


def cuda_built_torchvision_on_cpu_torch() -> bool:
    """torch has no CUDA and torchvision's C extension links CUDA libraries (read from the file, without loading)."""
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    if torch.version.cuda is not None:
        return False
    for extension in glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so")):
        with open(extension, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(b"libc10_cuda.so") >= 0 or data.find(b"libtorch_cuda.so") >= 0:
                return True
    return False


def sgl_kernel_stand_in() -> importlib.machinery.ModuleSpec | None:
    """Works around: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports names from ``sgl_kernel``, its CPU kernel package,
    which is not on PyPI (its wheels there are CUDA builds; the CPU one is built from SGLang's source tree, for
    AVX-512/AMX). On a CPU without AMX SGLang never calls them for plain generation (norms, activations, RoPE and
    attention take their torch fallbacks). Returns the spec that imports ``rlcore_rollout_sglang/sgl_kernel_cpu.py``
    under the name ``sgl_kernel`` — only when no real ``sgl_kernel`` is installed."""
    if importlib.machinery.PathFinder.find_spec("sgl_kernel") is not None:
        return None
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgl_kernel_cpu.py")
    return importlib.util.spec_from_file_location("sgl_kernel", here)


def shared_expert_gate_in_torch(name: str, path: Any) -> importlib.machinery.ModuleSpec | None:
    """Works around: SGLang's Qwen2-MoE adds the shared expert's output, scaled by its sigmoid gate, to the routed
    experts' output with a Triton kernel (``fused_gate_sigmoid_mul_add``, and ``fused_gate_sigmoid_mul`` out of
    place); Triton has no CPU driver ('0 active drivers' at the first prefill), and SGLang takes a torch path only for
    AMX, ROCm and NPU. Returns the spec of SGLang's module of those kernels (``name``) whose loader, after running it,
    swaps the Triton launch both call for ``gate_sigmoid_mul``."""
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _ThenPatch(spec.loader, _gate_in_torch)
    return spec


def gate_sigmoid_mul(hidden_states: Any, gate_weight: Any, shared_output: Any, output: Any, *, do_add: bool) -> None:
    """``output = sigmoid(hidden_states @ gate_weight) * shared_output (+ output if do_add)``, one gate value per token,
    computed in fp32 and stored in ``output``'s dtype: what SGLang's ``_fused_gate_sigmoid_mul_add_kernel`` does."""
    import torch

    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    result = gate * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result)


_TRITON_LAUNCH = "_launch_fused_gate_sigmoid_mul"


def _gate_in_torch(module: ModuleType) -> None:
    if not hasattr(module, _TRITON_LAUNCH):
        raise ImportError(f"{module.__name__} has no {_TRITON_LAUNCH}, which rlcore's CPU shim "
                          f"shared_expert_gate_in_torch replaces (written for SGLang 0.5.23): install "
                          f"contrib/rollout/sglang/requirements-sglang.txt's SGLang, or update the shim")
    setattr(module, _TRITON_LAUNCH, gate_sigmoid_mul)


def host_buffers_unpinned(name: str, path: Any) -> importlib.machinery.ModuleSpec | None:
    """Works around: SGLang allocates its host-side buffers (the routed-experts capture's host cache, which
    ``enable_return_routed_experts`` needs, and HiCache's pools) with ``pin_memory=True`` through
    ``ALLOC_MEMORY_FUNCS``, whose default pins by ``cudaHostRegister``; on the CPU torch that fails (``Torch not
    compiled with CUDA enabled`` while the scheduler starts). Pinning means nothing without a GPU. Returns the spec of
    SGLang's module of those allocators (``name``) whose loader, after running it, makes allocations for device
    ``"cpu"`` plain (the same allocator, not pinned)."""
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _ThenPatch(spec.loader, _cpu_buffers_unpinned)
    return spec


def alloc_unpinned(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any,
                   registration_granularity_bytes: int | None = None) -> Any:
    """SGLang's ``alloc_with_host_register`` without the registration (``pin_memory`` ignored)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


_HOST_ALLOCATORS = "ALLOC_MEMORY_FUNCS"


def _cpu_buffers_unpinned(module: ModuleType) -> None:
    if not hasattr(module, _HOST_ALLOCATORS):
        raise ImportError(f"{module.__name__} has no {_HOST_ALLOCATORS}, which rlcore's CPU shim "
                          f"host_buffers_unpinned patches (written for SGLang 0.5.23): install "
                          f"contrib/rollout/sglang/requirements-sglang.txt's SGLang, or update the shim")
    getattr(module, _HOST_ALLOCATORS)["cpu"] = alloc_unpinned


class _ThenPatch(importlib.abc.Loader):
    """Runs a module with its own loader, then ``patch(module)`` (before any importer sees it)."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, attr: str) -> Any:     # get_source, get_filename, ... (tracebacks, inspect)
        return getattr(self._loader, attr)


def enable(skip: tuple[str, ...] = ()) -> None:
    """Turn SGLang's CPU engine and the import hook's shims on for this process and the processes it starts from
    now on (they inherit the environment). ``skip`` leaves shims out (the tests that show each is still needed)."""
    os.environ[ENV] = "1"
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"   # else SGLang takes its CUDA path (its RoPE fallback imports vllm)
    os.environ[ENV + "_SKIP"] = ",".join(skip)
    from rlcore_rollout_sglang import startup

    startup.install()
    if "sgl_kernel" in sys.modules and "sgl_kernel_stand_in" in skip:
        raise RuntimeError("sgl_kernel is already imported in this process")


def bind_threads(tp: int) -> str:
    """Works around: SGLang's CPU engine runs at most one tensor-parallel rank per NUMA node unless
    ``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's cores (it asserts otherwise). Gives each of the ``tp`` ranks an
    equal, contiguous share of the cores this process may use, unless the variable is set already. Returns it."""
    if not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            from rlcore.errors import ConfigError

            raise ConfigError(f"rollout.tp={tp} with rollout.backend=sglang on CPU needs a core per engine rank; this "
                              f"process may use {len(cores)}: lower rollout.tp, or set SGLANG_CPU_OMP_THREADS_BIND")
        share = len(cores) // tp
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            _cpu_list(cores[i * share:(i + 1) * share]) for i in range(tp))
    return os.environ["SGLANG_CPU_OMP_THREADS_BIND"]


def _cpu_list(cores: list[int]) -> str:
    """SGLang's notation: ``first-last`` for a contiguous range, else comma-separated."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))
