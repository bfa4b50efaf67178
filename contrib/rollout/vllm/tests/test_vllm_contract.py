"""The rollout-backend contract (rlcore.testing.rollout) on the vLLM backend. The engine runs in a child process:
vLLM allows one in-process engine per process, and the test session's quickstart fixture may hold one."""
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from rlcore.testing.rollout import RegisteredBackend
from rlcore.testing.rollout_pytest import RolloutContract

pytestmark = [pytest.mark.slow]


class TestVLLMContract(RolloutContract):
    factory = RegisteredBackend("vllm")
    in_subprocess = True
