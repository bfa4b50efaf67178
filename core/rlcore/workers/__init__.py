"""Workers: one per device (one per process on CPU), each holding a Megatron shard and a colocated rollout engine."""
