"""Weights from the training layout to the rollout engine: the resharder (Megatron shards -> the engine's HF-named
tensors, bucketed), the transports (shared memory on one host, torch.distributed across hosts), the colocated mode
machine (``hybrid``: actor and engine share devices) and the engine-vs-actor logprob check."""
