"""Per-run names for vLLM-CPU's shared-memory all-reduce segments (vLLM 0.32).

vLLM's CPU communicator names its ``/dev/shm`` segments after the torch.distributed init method, which under the
external launcher is always ``env://``: every tensor-parallel engine on a host asks for the same names
(``-tp:0-[0-1]-cpushm_<rank>``). A second run beside the first, or any run after one that was killed (a killed
process leaves its segments behind), then fails to start with 'create shm in SHMManager failed. errno: 17'.

The rendezvous address and port of the trainer's world are shared by every rank of one run and by no two live runs
on a host, so they make the names the run's own.
"""
from __future__ import annotations

import os


def run_scoped_shm_names() -> None:
    """Prefix the segment names of every CPU communicator created from now on in this process (idempotent)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original = _CPUSHMDistributed.make_group_name
    if getattr(original, "run_scoped", False):
        return

    def make_group_name(communicator) -> str:
        port = os.environ.get("MASTER_PORT")
        name = original(communicator)   # '//-tp:0-[0-1]-cpushm' under env://: shm_open drops the leading slashes
        return f"rlcore{port}-{name.lstrip('/').lstrip('-')}" if port else name

    make_group_name.run_scoped = True   # type: ignore[attr-defined]
    setattr(_CPUSHMDistributed, "make_group_name", staticmethod(make_group_name))
