"""rlcore model plugin for Qwen2-VL and Qwen2.5-VL."""
