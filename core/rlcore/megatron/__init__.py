"""The Megatron-core backend: parallel state, model build from a ModelSpec, training and forward steps."""
