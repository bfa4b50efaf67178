"""rlcore model plugin for Qwen3."""
