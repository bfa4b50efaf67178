"""rlcore's test kit (the distribution rlcore-testing): ``models`` (model plugins' conformance checks on tiny random
checkpoints), ``rollout`` and ``rollout_pytest`` (the rollout-backend contract), ``gsm8k``, ``fp8`` and ``lora``
(test data and checkpoints built in-process); ``plugin``, loaded by pytest, registers its markers and fixtures.
Importing the package imports nothing heavy: pytest loads it in every session."""
