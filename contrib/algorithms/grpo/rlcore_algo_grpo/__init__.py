"""rlcore algorithm plugin: GRPO."""
