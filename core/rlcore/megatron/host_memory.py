"""Parts of a model's memory moved to host memory and back while another part of the run needs the device (the
engine in colocated mode, another model's pass): the storage is freed and refilled in place, so views of it (a
model's params in Megatron DDP's buffers) stay valid."""
from __future__ import annotations

import torch


def to_host(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy each tensor to host memory (pinned on CUDA, for fast copies back) and free its device storage; views of
    it, such as a model's params in Megatron DDP's buffers, stay valid. Returns (tensor, host copy) pairs."""
    pin = torch.cuda.is_available()
    moved = []
    for t in tensors:
        host = t.detach().to("cpu", copy=True)
        moved.append((t, host.pin_memory() if pin else host))
        t.untyped_storage().resize_(0)
    return moved


@torch.no_grad()
def to_device(moved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo ``to_host``: the storage is reallocated and filled from the host copy."""
    for t, host in moved:
        t.untyped_storage().resize_(host.numel() * host.element_size())
        t.copy_(host, non_blocking=True)


OFFLOAD_ORDER = ("optimizer", "grads", "params")   # onload runs the other way round


def offloaded_parts(offload) -> list[str]:
    """What an ``offload`` config section (actor.offload, critic.offload) moves to host memory, in the one order
    every trainable offloads in: the optimizer's state first, the parameters last (a weight push reads them)."""
    return [what for what in OFFLOAD_ORDER if offload is not None and getattr(offload, what)]
