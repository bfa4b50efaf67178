"""Shims for megatron-core, in one registry (``registry``): ``cpu`` lets it run without CUDA on gloo, ``compat`` and
``optimizer`` fill gaps that are not about the device. Importing the package registers them; ``apply()`` patches
megatron-core (called once per process by ``rlcore.megatron.parallel.init_parallel``, before any model is built)."""
from rlcore.megatron.patches import cpu  # noqa: F401  (importing registers its shims; applied first)
from rlcore.megatron.patches import compat  # noqa: F401
from rlcore.megatron.patches import optimizer  # noqa: F401
from rlcore.megatron.patches.registry import SHIMS, Shim, apply, describe, planned

__all__ = ["SHIMS", "Shim", "apply", "describe", "planned"]
