"""The rollout-backend contract (rlcore_testing.rollout) on the transformers backend: it is the reference's own code,
so this mostly checks its sampling loop (seeds, finish reasons, temperature), its weight reload and the routed
experts it keeps per request (on a tiny Qwen3-MoE, Mixtral and DeepSeek-V3, whose first layer is dense)."""
from rlcore_testing.contract import RegisteredBackend
from rlcore_testing.rollout_pytest import RolloutContract


class TestHFContract(RolloutContract):
    factory = RegisteredBackend("hf")
    not_applicable = {"release_and_resume_memory": "the transformers backend keeps its model (can_release_memory "
                                                   "is false)"}
    routed_experts_models = ("qwen3_moe", "mixtral", "deepseek_v3")
