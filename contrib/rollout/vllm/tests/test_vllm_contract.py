"""The rollout-backend contract (rlcore_testing.rollout) on the vLLM backend. The engine runs in a child process:
vLLM allows one in-process engine per process, and the test session's quickstart fixture may hold one."""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from rlcore_testing.contract import RegisteredBackend
from rlcore_testing.rollout_pytest import RolloutContract

pytestmark = [pytest.mark.slow]


class TestVLLMContract(RolloutContract):
    factory = RegisteredBackend("vllm")
    in_subprocess = True
    not_applicable = {} if torch.cuda.is_available() else {
        "release_and_resume_memory": "vLLM's CPU build has no sleep mode: it cannot release memory",
        "routed_experts": "vLLM's CPU build cannot return routed experts (its V2 model runner needs Triton)"}


def test_an_async_rollout_worker_at_tp_above_1_is_refused_in_one_line():
    """Without the external launcher (colocated) the engine would silently run at tp 1."""
    from types import SimpleNamespace

    from rlcore_rollout_vllm.backend import VLLMRollout

    with pytest.raises(ValueError, match=r"rollout.backend=vllm hosts rollout.tp=2 only colocated .* or "
                                         r"rollout.backend=sglang"):
        VLLMRollout("unused", SimpleNamespace(tp=2), distributed=False)
