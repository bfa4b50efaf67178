"""The rollout-backend contract (rlcore.testing_rollout) on the transformers backend: it is the reference's own code,
so this mostly checks its sampling loop (seeds, finish reasons, temperature) and its weight reload."""
from rlcore.testing_rollout import RegisteredBackend, contract_tests

globals().update(contract_tests(RegisteredBackend("hf")))
