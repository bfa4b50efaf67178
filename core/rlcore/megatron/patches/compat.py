"""Shims for gaps in megatron-core that are not about CPU: they apply on GPUs too, whenever the condition they are
registered with holds (TransformerEngine missing); the distributed optimizer's over torch's Adam are in
``optimizer``. Context parallelism without TransformerEngine lives in the attention module the layer specs use
(rlcore.megatron.attention)."""
from __future__ import annotations

from rlcore.megatron.patches.registry import shim, without_transformer_engine


@shim("moe")
def define_te_general_gemm_without_transformer_engine() -> None:
    """moe_utils imports ``te_general_gemm`` only when TransformerEngine is installed, yet the MoE router's gating
    function tests ``te_general_gemm is not None`` unconditionally: without TE every MoE forward raises
    NameError. Define it as None so the router takes its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@shim("tp2-sp", when=without_transformer_engine)
def sequence_parallel_torch_norms() -> None:
    """megatron-core's torch (non-TE) norms refuse sequence parallelism, though nothing in them depends on it: a norm
    is per token. Build them with the flag off and tag their parameters ``sequence_parallel`` so that
    ``finalize_model_grads`` all-reduces their gradients over the TP group (each TP rank saw only its part of the
    sequence), which is what TE's norms get."""
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_rlcore_sp", False):
        return
    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__
    torch_norm.WrappedTorchNorm._rlcore_sp = True


@shim("mla", when=without_transformer_engine)
def multi_latent_attention_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MLA module sets ``HAVE_TE`` when its TE extension imports, which it does without TE
    (as mock classes); MLA's constructor then calls ``isinstance(linear_proj, <mock>)`` and raises TypeError."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


@shim("mla-tp2-sp")
def multi_latent_attention_reduces_the_positional_key_gradient() -> None:
    """megatron-core 0.16.1's MLA with a column-parallel ``linear_kv_down_proj`` (its local spec) gathers that
    projection's output over TP and splits off the positional key, which each TP rank expands over its own heads
    only; the gather's backward keeps each rank's own slice, so the positional rows' gradient is the sum over one
    rank's heads, never reduced over TP (NVIDIA/Megatron-LM#1699, open): at TP > 1 the down projection's gradient and
    every gradient before it are wrong (a DeepSeek-V3 LoRA update at TP2 differed from TP1 by 3 %). A forward hook
    gathers the output itself, so the attention takes the path it takes for a replicated (duplicated) projection:
    with sequence parallelism the output is cut back to this rank's sequence chunk and the attention gathers the
    positional key over the sequence, whose backward reduce-scatters (sums) its gradient; without, the positional
    columns pass a TP region that all-reduces their gradient. The forward values are unchanged."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if getattr(MLASelfAttention, "_rlcore_positional_key", False):
        return
    original = MLASelfAttention.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        down = self.linear_kv_down_proj
        if isinstance(down, ColumnParallelLinear) and down.tp_group is not None and down.tp_group.size() > 1:
            down.register_forward_hook(_kv_down_output_whole(self.config.qk_pos_emb_head_dim, down.tp_group,
                                                             self.config.sequence_parallel))

    MLASelfAttention.__init__ = __init__
    MLASelfAttention._rlcore_positional_key = True


def _kv_down_output_whole(positional: int, group, sequence_parallel: bool):
    """The forward hook of ``multi_latent_attention_reduces_the_positional_key_gradient``."""
    import torch
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)

    def hook(module, args, output):
        out, bias = output
        whole = gather_from_tensor_model_parallel_region(out, group=group)
        if sequence_parallel:
            return scatter_to_sequence_parallel_region(whole, group=group), bias
        compressed, key = whole.split([whole.shape[-1] - positional, positional], dim=-1)
        return torch.cat([compressed, copy_to_tensor_model_parallel_region(key, group=group)], dim=-1), bias

    return hook


@shim("checkpoint")
def checkpoint_writes_without_a_spawned_manager() -> None:
    """The first checkpoint save starts a ``multiprocessing`` Manager through the *spawn* context to carry write
    results back from the writer processes; spawn re-imports ``__main__``, so a save from any script without an
    ``if __name__ == "__main__"`` guard (a user's, a Ray worker's) dies with EOFError, and starting it costs seconds.
    The writers are forked (megatron-core's non-persistent async caller and the synchronous save's workers), so a
    Manager forked from this process serves them, in milliseconds. (A plain pipe-backed queue does not: a put from
    this process reaches the pipe only later, through a feeder thread, and a forked writer's put of more than a pipe
    buffer of results would block its exit until read.) The forked Manager exits with this process: it holds a copy
    of every descriptor this process had, Ray's connection to a worker among them, and outliving a killed worker it
    would hide the worker's death from Ray (the run would wait on the dead worker forever).

    Each save gets a queue of its own (megatron-core hands every save the one process-wide queue): a finished save
    takes the first result in its queue as its own, so two saves in flight in one process (a world-of-one run's
    actor and critic, saved together) could each take the other's write results and record the other's file
    offsets in their metadata: a checkpoint that reads back garbage (seen: kill-and-resume of PPO under load)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async._get_write_results_queue, "_rlcore", False):
        return
    managers: list[SyncManager] = []

    def forked_manager_queue():
        if not managers:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=exit_with_parent)
            managers.append(manager)
        return managers[0].Queue()

    forked_manager_queue._rlcore = True  # type: ignore[attr-defined]
    filesystem_async._get_write_results_queue = forked_manager_queue


def exit_with_parent() -> None:
    """In a forked helper process: exit as soon as the process that forked it is gone (its parent changes)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="rlcore-exit-with-parent", daemon=True).start()


# what torch.distributed.checkpoint's `.metadata` pickle may name: its own metadata classes and torch's type names
_CHECKPOINT_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool"},
    "collections": {"OrderedDict"},
}


@shim("crafted-checkpoint")
def checkpoint_loading_never_unpickles_code() -> None:
    """torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with ``pickle.load`` and its non-tensor items
    with ``torch.load(weights_only=False)``: a crafted checkpoint runs code when loaded. Read the metadata with an
    unpickler that knows only the metadata classes, and the items with ``weights_only=True`` (rlcore's are None:
    the layers' empty ``_extra_state``). megatron-core's ``common.pt`` is read with torch's default, weights only."""
    import io
    import pickle
    import types

    import torch
    from torch.distributed.checkpoint import default_planner, filesystem

    if getattr(filesystem.pickle, "_rlcore", False):
        return

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if name not in _CHECKPOINT_METADATA_GLOBALS.get(module, ()):
                raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not checkpoint "
                                             f"metadata: refused (a checkpoint never loads code)")
            return super().find_class(module, name)

    filesystem.pickle = types.SimpleNamespace(  # type: ignore[assignment]
        dump=pickle.dump, dumps=pickle.dumps, load=lambda f: MetadataUnpickler(f).load(),
        loads=lambda data: MetadataUnpickler(io.BytesIO(data)).load(), _rlcore=True)

    class TensorsOnlyTorch:
        """``torch`` as the load planner sees it: ``torch.load`` reads tensors and plain data only."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def load(f, *args, **kwargs):
            return torch.load(f, *args, **{**kwargs, "weights_only": True})

    default_planner.torch = TensorsOnlyTorch()  # type: ignore[assignment]
