"""Registers the vLLM rollout backend."""
from rlcore.hookspecs import hookimpl
from rlcore.specs import RolloutBackendSpec


def _make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True, lora_rank=0,
          routed_experts=False):
    from rlcore_rollout_vllm.backend import VLLMRollout

    return VLLMRollout(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                       load_weights=load_weights, lora_rank=lora_rank, routed_experts=routed_experts)


@hookimpl
def rlcore_rollout_backends():
    # routed experts: GPU only (vLLM's enable_return_routed_experts needs its V2 model runner, which needs Triton;
    # the CPU build has none): README
    return [RolloutBackendSpec("vllm", _make, lora_adapters=True, images=True, routed_experts=("cuda",))]
