"""Run at every interpreter start by ``rlcore_rollout_sglang.pth`` (so SGLang's spawned scheduler and detokenizer
processes run it too): puts the CPU shims' import hook (``rlcore_rollout_sglang.cpu``) first on ``sys.meta_path``.
It imports nothing else; the hook acts only when ``torchvision``, ``sgl_kernel``, SGLang's elementwise Triton kernels
(``GATE_KERNELS``) or its host-buffer allocators (``HOST_ALLOCATORS``) are imported.

- ``torchvision``: in every process, because a CUDA-built torchvision next to the CPU torch breaks transformers'
  model imports too, not only SGLang (the shim checks that this is the case before acting);
- ``sgl_kernel``, ``GATE_KERNELS`` and ``HOST_ALLOCATORS``: only in processes whose environment has
  ``RLCORE_SGLANG_CPU_SHIMS=1`` (the backend sets it before starting SGLang on CPU).
"""
import os
import sys

ENV = "RLCORE_SGLANG_CPU_SHIMS"
GATE_KERNELS = "sglang.kernels.ops.elementwise.elementwise"
HOST_ALLOCATORS = "sglang.srt.mem_cache.pool_host.common"


def _skipped() -> list[str]:
    return os.environ.get(ENV + "_SKIP", "").split(",")


class CpuShimFinder:
    """A ``sys.meta_path`` finder that never finds anything itself except the ``sgl_kernel`` stand-in, SGLang's
    elementwise kernels with their shared-expert gate in torch, and its host-buffer allocators unpinned on CPU."""

    def __init__(self) -> None:
        self.torchvision_seen = False

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not self.torchvision_seen:
            self.torchvision_seen = True
            if "torchvision_op_schemas" not in _skipped():
                from rlcore_rollout_sglang import cpu

                cpu.torchvision_op_schemas()
            return None         # the normal finders import torchvision
        if os.environ.get(ENV) != "1":
            return None
        if name == "sgl_kernel" and "sgl_kernel_stand_in" not in _skipped():
            from rlcore_rollout_sglang import cpu

            return cpu.sgl_kernel_stand_in()
        if name == GATE_KERNELS and "shared_expert_gate_in_torch" not in _skipped():
            from rlcore_rollout_sglang import cpu

            return cpu.shared_expert_gate_in_torch(name, path)
        if name == HOST_ALLOCATORS and "host_buffers_unpinned" not in _skipped():
            from rlcore_rollout_sglang import cpu

            return cpu.host_buffers_unpinned(name, path)
        return None


def install() -> None:
    """Idempotent."""
    if not any(type(f).__name__ == "CpuShimFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, CpuShimFinder())


install()
