"""rlcore model plugin: MixtralForCausalLM."""
