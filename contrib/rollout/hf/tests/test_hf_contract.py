"""The rollout-backend contract (rlcore_testing.rollout) on the transformers backend: it is the reference's own code,
so this mostly checks its sampling loop (seeds, finish reasons, temperature) and its weight reload."""
from rlcore_testing.contract import RegisteredBackend
from rlcore_testing.rollout_pytest import RolloutContract


class TestHFContract(RolloutContract):
    factory = RegisteredBackend("hf")
    not_applicable = {"release_and_resume_memory": "the transformers backend keeps its model (can_release_memory "
                                                   "is false)"}
