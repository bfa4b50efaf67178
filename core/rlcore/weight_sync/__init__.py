"""Weights from the training layout to the rollout engine: the transports that carry the resharder's buckets
(``rlcore.megatron.reshard``: Megatron shards -> the engine's HF-named tensors; shared memory on one host,
torch.distributed across hosts), the push to separate rollout workers, the colocated mode machine (``hybrid``: actor
and engine share devices) and the engine-vs-actor logprob check."""
