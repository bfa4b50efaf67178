"""Registers the SGLang rollout backend."""
import importlib.util

from rlcore.errors import ConfigError
from rlcore.hookspecs import hookimpl
from rlcore.specs import RolloutBackendSpec

INSTALL = ("pip install --no-deps -c scripts/constraints.txt -r contrib/rollout/sglang/requirements-sglang.txt "
           "(from an rlcore checkout; scripts/install.sh does it)")


def _make(model_path, cfg, seed=0, max_model_len=None, distributed=False):
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"rollout.backend=sglang needs SGLang, which is not installed: {INSTALL}")
    from rlcore_rollout_sglang.backend import SGLangRollout

    return SGLangRollout(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed)


@hookimpl
def rlcore_rollout_backends():
    return [RolloutBackendSpec("sglang", _make)]
