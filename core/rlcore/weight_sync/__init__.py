"""Weights from the training layout to the rollout engine: the resharder (``rlcore.megatron.reshard``: Megatron
shards -> the engine's HF-named tensors, its buckets assembled by ``rlcore.megatron.exchange``: shared memory on one
host, torch.distributed across hosts) feeds the push to separate rollout workers and the colocated mode machine
(``hybrid``: actor and engine share devices); and the engine-vs-actor logprob check."""
