"""SGLang's offline ``Engine`` as an rlcore RolloutBackend (a tokenizer-free engine fed token ids).

Unlike the vLLM backend the engine does not run in this process: SGLang starts a scheduler process (the model, its KV
cache, sampling) and a detokenizer process, and talks to them over ZeroMQ; weight updates are handed over as tensors
in shared memory (``update_weights_from_tensor``), without a file.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import random
import time
from typing import Any, Iterable, Sequence

import torch

from rlcore.specs import Generation, RolloutBackend

BUCKET_BYTES = 256 << 20    # weights handed to the engine per update_weights_from_tensor call
log = logging.getLogger(__name__)


class SGLangRollout(RolloutBackend):
    """``distributed``: the trainer's ranks form replicas of ``rollout.tp`` consecutive ranks. SGLang's offline Engine
    has no external launcher (its tensor-parallel ranks are processes it spawns), so each replica's first rank hosts
    the replica's whole engine (``tp_size=rollout.tp``) and shares its results with the replica's other ranks, which
    still take part in every weight push (the resharder's exchange is collective) but hold no engine."""
    can_release_memory = False  # set in __init__: GPU only (SGLang's memory saver is CUDA-only)

    def __init__(self, model_path: str, cfg, seed: int = 0, max_model_len: int | None = None,
                 distributed: bool = False, **engine_overrides: Any):
        tp = getattr(cfg, "tp", 1)
        self.replica = Replica(tp, distributed)
        self._seeds_warned = False
        self._rng = random.Random(seed)
        self._released: list[str] = []
        if not self.replica.leads:
            return
        cpu = not torch.cuda.is_available()
        if cpu:
            from rlcore_rollout_sglang import cpu as shims

            shims.enable()
            if tp > 1:
                shims.bind_threads(tp)
        import psutil
        import sglang

        args: dict[str, Any] = dict(model_path=model_path, skip_tokenizer_init=True, random_seed=seed,
                                    log_level="error", skip_server_warmup=True, tp_size=tp)
        self._memory_tags = ["kv_cache", "weights"]
        if not cpu and importlib.util.find_spec("torch_memory_saver") is not None:
            self.can_release_memory = True
            args["enable_memory_saver"] = True
            if not engine_overrides.get("disable_cuda_graph"):
                self._memory_tags.append("cuda_graph")
        if max_model_len is not None:
            args["context_length"] = max_model_len
        if cpu:
            args.update(device="cpu", dtype="float32",
                        attention_backend="torch_native",  # the CPU default (intel_amx) needs the real sgl_kernel
                        sampling_backend="pytorch", disable_cuda_graph=True,
                        sleep_on_idle=True,                # else the idle scheduler busy-polls a core
                        # the KV cache is max_total_tokens (rollout.kv_cache_gib); the fraction only gates SGLang's
                        # start check that the loaded weights leave memory free, measured against the memory free
                        # at start, which the other ranks' engines loading on the same host also take (a fixed
                        # 0.05 failed it for a 0.5B model, 0.17 with two engines starting at once)
                        mem_fraction_static=0.9,
                        max_total_tokens=_kv_cache_tokens(model_path, cfg.kv_cache_gib))
        args.update(engine_overrides)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        start_method = multiprocessing.get_start_method(allow_none=True)
        # under torchrun this process's environment says "join the launcher's store": SGLang's scheduler, which
        # inherits it, would then wait forever for its own rendezvous in a store that never answers
        agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        try:
            self.engine = sglang.Engine(**args)
        finally:
            if agent_store is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
            multiprocessing.set_start_method(start_method, force=True)  # SGLang forces "spawn" process-wide
        self._pids = {p.pid for p in psutil.Process().children(recursive=True)} - before

    def generate(self, prompts: Sequence[list[int]], n: int, temperature: float, max_tokens: int,
                 seeds: Sequence[int] | None = None) -> list[list[Generation]]:
        """One request per sample. SGLang's returned logprobs are already the sampling policy's (log of the softmax
        of logits / temperature; at temperature 0, of the logits), the vLLM backend's processed logprobs.

        Seeds: each sample gets its own ``sampling_seed``, but SGLang 0.5.23 uses it only in its deterministic-inference
        mode, whose attention backends are GPU-only; on CPU the samples come from the scheduler's global generator
        (seeded once with the engine's seed), so they depend on the calls made before. Warned once."""
        if seeds is not None and not torch.cuda.is_available() and not self._seeds_warned:
            self._seeds_warned = True
            log.warning("rollout.backend=sglang on CPU cannot seed each prompt (SGLang applies sampling_seed only in "
                        "its GPU-only deterministic mode): samples depend on the engine's seed and call order")
        base = list(seeds) if seeds is not None else [self._rng.getrandbits(62) for _ in prompts]
        if not self.replica.leads:
            return self.replica.share(None)
        params = [{"n": 1, "temperature": temperature, "max_new_tokens": max_tokens,
                   "sampling_seed": _sample_seed(s, k)} for s in base for k in range(n)]
        out = self.engine.generate(input_ids=[list(p) for p in prompts for _ in range(n)], sampling_params=params,
                                   return_logprob=True)
        gens = [Generation(list(o["output_ids"]), [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                           _finish_reason(o["meta_info"]["finish_reason"])) for o in out]
        return self.replica.share([gens[i * n:(i + 1) * n] for i in range(len(prompts))])

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        """Prompt logprobs at temperature 1. SGLang's window starts at ``logprob_start_len`` and has no logprob for
        its first token, so it starts one token before ``start``."""
        if any(s < 1 for s in start):
            raise ValueError("score: a sequence's first token has no logprob (start must be >= 1)")
        if not self.replica.leads:
            return self.replica.share(None)
        out = self.engine.generate(input_ids=[list(s) for s in sequences],
                                   sampling_params={"max_new_tokens": 1, "temperature": 1.0},
                                   return_logprob=True, logprob_start_len=[s - 1 for s in start])
        result = []
        for o, seq, st in zip(out, sequences, start):
            window = o["meta_info"]["input_token_logprobs"][1:]
            if len(window) != len(seq) - st:
                raise RuntimeError(f"SGLang returned {len(window)} prompt logprobs for {len(seq) - st} tokens")
            result.append([lp for lp, _, _ in window])
        return self.replica.share(result)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hands the stream to the engine bucket by bucket (at most ``BUCKET_BYTES`` each, as shared-memory tensors)
        inside one weight-update session, and flushes the prefix cache in it so no KV computed with the old weights
        is reused. A rank without an engine still pulls the stream: the exchange behind it is collective."""
        if not self.replica.leads:
            for _ in named_tensors:
                pass
            return
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in named_tensors:
                bucket.append((name, tensor.detach()))
                size += tensor.numel() * tensor.element_size()
                if size >= BUCKET_BYTES:
                    self._push(bucket)
                    bucket, size = [], 0
            if bucket:
                self._push(bucket)
            self.flush_cache()
        finally:
            _check(self.engine.end_weight_update(), "end_weight_update")

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not torch.cuda.is_available():
            bucket = _in_shared_memory(bucket)
        _check(self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
               "update_weights_from_tensor")

    def release_memory(self) -> None:
        if self.replica.leads:
            _check(self.engine.release_memory_occupation(tags=self._memory_tags), "release_memory_occupation")
            self._released = list(self._memory_tags)

    def resume_memory(self, what: str) -> None:
        """``"weights"`` before a push, ``"kv_cache"`` (with its CUDA graphs) before generating."""
        tags = [t for t in self._released if (t == "weights") == (what == "weights")]
        if self.replica.leads and tags:
            _check(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
            self._released = [t for t in self._released if t not in tags]

    def flush_cache(self, timeout: float = 30.0) -> None:
        """Empties the prefix cache, inside a weight-update session: an empty update that flushes. (``Engine.
        flush_cache`` also runs a ``gc.collect()`` in the scheduler, 0.43 s of a 0.44 s sync on CPU; this takes
        2 ms.) SGLang refuses a flush while requests are still being retired; retried until it takes."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.engine.update_weights_from_tensor(named_tensors=[], flush_cache=True)
            success, message = _outcome(result)
            if success:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang did not flush its prefix cache within {timeout:g} s: {message}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Shuts the engine down and waits for its processes (idempotent). SGLang's own ``shutdown`` kills every child
        of this process; here only the engine's own processes are killed."""
        engine = vars(self).pop("engine", None)
        if engine is None:
            return
        import atexit

        import psutil
        from sglang.srt.entrypoints import engine as engine_module

        atexit.unregister(engine.shutdown)
        kill_tree = engine_module.kill_process_tree

        def kill_engine_processes(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
            procs = []
            for pid in self._pids:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
            for p in procs:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=wait_timeout)

        engine_module.kill_process_tree = kill_engine_processes
        try:
            engine.shutdown()
        finally:
            engine_module.kill_process_tree = kill_tree


class Replica:
    """This rank's place among the ranks sharing one engine (``tp`` consecutive ranks of the trainer's world)."""

    def __init__(self, tp: int, distributed: bool):
        self.group = None
        self.leader = 0
        if distributed and tp > 1:
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
            # new_group is collective: every rank creates every replica's group, in the same order
            groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world, tp)]
            self.group, self.leader = groups[rank // tp], rank - rank % tp
        self.leads = self.group is None or self.leader == torch.distributed.get_rank()

    def share(self, result: Any) -> Any:
        """The leader's ``result`` on every rank of the replica."""
        if self.group is None:
            return result
        box = [result]
        torch.distributed.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


def _in_shared_memory(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket copied into one new shared-memory buffer. SGLang pickles CPU tensors for its scheduler by sharing
    their storage's file descriptor: a resharder slot (a mapped /dev/shm file, already unlinked) has none to share,
    and an actor parameter's storage would be moved into shared memory in place."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for _, t in bucket]     # 64-byte aligned
    flat = torch.empty(sum(sizes), dtype=torch.uint8).share_memory_()
    copies, offset = [], 0
    for (name, tensor), size in zip(bucket, sizes):
        nbytes = tensor.numel() * tensor.element_size()
        copy = flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append((name, copy))
        offset += size
    return copies


def _sample_seed(prompt_seed: int, k: int) -> int:
    """Sample k of a prompt's n: a function of the prompt's seed alone."""
    return (prompt_seed * 1_000_003 + k) % (1 << 62)


def _finish_reason(reason: dict | None) -> str:
    """SGLang's ``{"type": "stop"|"length"|"abort", ...}`` as vLLM's finish reason string."""
    return (reason or {}).get("type", "")


def _outcome(result: Any) -> tuple[bool, str]:
    """SGLang's calls answer ``(success, message)`` or an object with both."""
    return (result.success, result.message) if hasattr(result, "success") else (result[0], result[1])


def _check(result: Any, what: str) -> None:
    success, message = _outcome(result)
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _kv_cache_tokens(model_path: str, gib: float) -> int:
    """Tokens of KV cache that ``gib`` GiB hold for the checkpoint at ``model_path`` (fp32 on CPU)."""
    with open(os.path.join(model_path, "config.json")) as f:
        hf = json.load(f)
    heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * heads * head_dim * 4
    return max(1024, int(gib * (1 << 30)) // per_token)
