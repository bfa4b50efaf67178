"""rlcore rollout plugin: vLLM."""
