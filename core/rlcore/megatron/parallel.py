"""torch.distributed + Megatron parallel state. NCCL on CUDA, gloo on CPU; device selection is the only branch."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0, ep: int = 1, cp: int = 1) -> None:
    """Initialise torch.distributed (from the launcher's env, or as a world of one) and Megatron's groups."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlcore.megatron import patches

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:  # a single process: no rendezvous port needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    patches.apply()
    if not mpu.model_parallel_is_initialized():
        # experts: split over `ep` ranks (carved out of data parallelism), each expert whole (no expert TP)
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      context_parallel_size=cp, expert_model_parallel_size=ep,
                                      expert_tensor_parallel_size=1)
    # seeded on every call, not only the first: a model built later in the same process (a test session, the
    # critic next to the actor) gets the same initial weights as in a fresh one. Megatron-LM seeds the default
    # generator per pipeline stage as well; router/bias init draw from it.
    torch.manual_seed(seed + 100 * mpu.get_pipeline_model_parallel_rank())
    model_parallel_cuda_manual_seed(seed)


def shutdown_parallel() -> None:
    """Tear down Megatron's groups and torch.distributed before a process exits; call it once nothing references a
    model. A process group still alive at interpreter exit is torn down there, where gloo aborted the process
    ("terminate called without an active exception") in a few runs of 30."""
    import gc

    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
