"""One registry of the shims rlcore applies to megatron-core: each records the megatron-core version it was written
for, what it works around (its docstring), whether it is only for processes without CUDA, any other condition it
applies under, and the smallest case that fails without it (``tests/integration/test_cpu_shims.py`` removes each shim in
turn and checks that case still fails, so a shim megatron-core no longer needs shows up as a failing test).

Conditions are read without importing megatron-core, so the driver can list what its workers will apply
(``planned``, stored in run.json) without applying anything."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from rlcore.megatron.attention import have_transformer_engine

log = logging.getLogger(__name__)

WRITTEN_FOR = "0.16.1"         # the megatron-core version rlcore pins and every shim below was verified against


@dataclass(frozen=True)
class Shim:
    name: str
    patch: Callable[[], None]
    needed_by: str                       # the case of tests/integration/test_cpu_shims.py that fails without it
    cpu_only: bool                       # only in a process without CUDA
    when: Callable[[], bool]             # any other condition, e.g. "TransformerEngine is not installed"
    written_for: str = WRITTEN_FOR

    @property
    def why(self) -> str:
        return self.patch.__doc__ or ""

    def applies_here(self) -> bool:
        return (not self.cpu_only or not torch.cuda.is_available()) and self.when()


SHIMS: dict[str, Shim] = {}
_applied: set[str] = set()


def always() -> bool:
    return True


def without_transformer_engine() -> bool:
    return not have_transformer_engine()


def with_torch_adam() -> bool:
    """megatron-core's distributed optimizer wraps torch.optim.Adam when neither TransformerEngine's nor Apex's
    FusedAdam is installed (its ``HAVE_APEX_OR_TE``)."""
    return without_transformer_engine() and importlib.util.find_spec("apex") is None


def shim(needed_by: str, cpu_only: bool = False, when: Callable[[], bool] = always):
    """Register the decorated function as a shim (in definition order, which is the order they are applied in)."""
    def register(patch: Callable[[], None]) -> Callable[[], None]:
        SHIMS[patch.__name__] = Shim(patch.__name__, patch, needed_by, cpu_only, when)
        return patch
    return register


def planned() -> list[Shim]:
    """The shims this process would apply, in order, without applying them."""
    return [s for s in SHIMS.values() if s.applies_here()]


def describe() -> list[dict[str, str]]:
    """What run.json records: the shims the workers apply (the driver's machine has their device) and the
    megatron-core version each was written for."""
    return [dict(name=s.name, megatron_core=s.written_for) for s in planned()]


def apply() -> None:
    """Apply every shim that applies here, once per process (later calls are no-ops). On a megatron-core version
    other than the one a shim was written for, one warning names those shims: a newer version may still need them
    and work with them, which the shim tests decide, so this does not refuse."""
    new = [s for s in planned() if s.name not in _applied]
    for s in new:
        s.patch()
        _applied.add(s.name)
    warn_unverified(new)


def warn_unverified(shims: list[Shim]) -> None:
    from megatron.core import __version__ as installed

    unverified = [s.name for s in shims if s.written_for != installed]
    if unverified:
        log.warning("megatron-core %s is installed; these shims were written for %s and not verified for it: %s "
                    "(tests/integration/test_cpu_shims.py checks each is still needed)", installed,
                    "/".join(sorted({s.written_for for s in shims if s.written_for != installed})),
                    ", ".join(unverified))
