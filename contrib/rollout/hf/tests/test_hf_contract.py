"""The rollout-backend contract (rlcore.testing.rollout) on the transformers backend: it is the reference's own code,
so this mostly checks its sampling loop (seeds, finish reasons, temperature) and its weight reload."""
from rlcore.testing.rollout import RegisteredBackend
from rlcore.testing.rollout_pytest import RolloutContract


class TestHFContract(RolloutContract):
    factory = RegisteredBackend("hf")
