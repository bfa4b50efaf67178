"""Registers the SGLang rollout backend."""
import importlib.util

from rlcore.errors import ConfigError
from rlcore.hookspecs import hookimpl
from rlcore.specs import RolloutBackendSpec

INSTALL = ("pip install --no-deps -c scripts/constraints.txt -r contrib/rollout/sglang/requirements-sglang.txt "
           "(from an rlcore checkout; scripts/install.sh does it)")


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"rollout.backend=sglang needs SGLang, which is not installed: {INSTALL}")


def _make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True, routed_experts=False):
    _require_sglang()
    from rlcore_rollout_sglang.backend import SGLangRollout

    return SGLangRollout(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                         routed_experts=routed_experts, **({} if load_weights else {"load_format": "dummy"}))


def _check(hf_config: dict, cfg, here: bool) -> None:
    import torch

    from rlcore_rollout_sglang.architectures import unservable

    _require_sglang()
    reason = unservable(hf_config, on_cpu=here and not torch.cuda.is_available())
    if reason:
        raise ConfigError(f"rollout.backend=sglang cannot serve this model: {reason}. Use rollout.backend=vllm")


@hookimpl
def rlcore_rollout_backends():
    # routed experts: on CPU with the host_buffers_unpinned shim (rlcore_rollout_sglang/cpu.py)
    return [RolloutBackendSpec("sglang", _make, _check, routed_experts=("cpu", "cuda"))]
