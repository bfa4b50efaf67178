"""rlcore model plugin for Qwen2 / Qwen2.5 and Qwen2-MoE."""
