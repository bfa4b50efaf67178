"""SGLang's offline ``Engine`` as an rlcore RolloutBackend (a tokenizer-free engine fed token ids).

Unlike the vLLM backend the engine does not run in this process: SGLang starts a scheduler process (the model, its KV
cache, sampling) and a detokenizer process, and talks to them over ZeroMQ; weight updates are handed over as tensors
in shared memory (``update_weights_from_tensor``), without a file. Requests go through the engine's tokenizer manager,
which lives on the event loop of the thread that built the engine: call ``generate`` from that thread
(``rlcore.rollout.requests`` keeps one loop per thread).
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import multiprocessing
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from rlcore.hf_config import read_config_json
from rlcore.specs import Completion, RolloutBackend, Sampling
from rlcore_rollout_sglang.messages import (check_result, finish_reason, in_shared_memory, kv_cache_tokens,
                                            outcome, routes_of, sampling_params)
from rlcore_rollout_sglang.replica import Replica

BUCKET_BYTES = 256 << 20    # weights handed to the engine per update_weights_from_tensor call
log = logging.getLogger(__name__)


class SGLangRollout(RolloutBackend):
    """``distributed``: the trainer's ranks form replicas of ``rollout.tp`` consecutive ranks. SGLang's offline Engine
    has no external launcher (its tensor-parallel ranks are processes it spawns), so each replica's first rank hosts
    the replica's whole engine (``tp_size=rollout.tp``) and shares its results with the replica's other ranks, which
    still take part in every weight push (the resharder's exchange is collective) but hold no engine."""
    can_release_memory = False  # set in __init__: GPU only (SGLang's memory saver is CUDA-only)

    def __init__(self, model_path: str, cfg, seed: int = 0, max_model_len: int | None = None,
                 distributed: bool = False, routed_experts: bool = False, **engine_overrides: Any):
        """``routed_experts``: every completion carries the experts each MoE layer routed its tokens to
        (``Completion.routed_experts``; SGLang's ``enable_return_routed_experts``)."""
        tp = getattr(cfg, "tp", 1)
        self.replica = Replica(tp, distributed)
        self._seeds_warned = False
        self._rng = random.Random(seed)
        self._released: list[str] = []
        self._asked: set[str] = set()                  # the request ids in flight on this rank
        self._in_flight: dict[str, _Request] = {}      # the engine's requests, by the caller's request id
        self._unsent: list[_Request] = []              # added since the last batch went to the engine
        self._sending: set[asyncio.Task] = set()
        self._hf_config = read_config_json(model_path) if routed_experts else None
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
        if routed_experts:
            args["enable_return_routed_experts"] = True
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
                        max_total_tokens=kv_cache_tokens(model_path, cfg.kv_cache_gib))
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
        self.engine.loop = _LoopFromAnyThread(self.engine.loop)

    async def generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str) -> Completion:
        """SGLang's returned logprobs are already the sampling policy's (log of the softmax of logits / temperature;
        at temperature 0, of the logits), the vLLM backend's processed logprobs.

        Seeds: the request's ``sampling_seed``, but SGLang 0.5.23 uses it only in its deterministic-inference mode,
        whose attention backends are GPU-only; on CPU the samples come from the scheduler's global generator (seeded
        once with the engine's seed), so they depend on the requests before and beside. Warned once."""
        if seed is not None and not torch.cuda.is_available() and not self._seeds_warned:
            self._seeds_warned = True
            log.warning("rollout.backend=sglang on CPU cannot seed each request (SGLang applies sampling_seed only in "
                        "its GPU-only deterministic mode): samples depend on the engine's seed and the requests made")
        if request_id in self._asked:       # checked on every rank of a replica, so that all refuse it alike
            raise ValueError(f"generate: request id {request_id!r} is already in flight (ids must be unique among "
                             f"the requests in flight)")
        params = sampling_params(sampling, seed if seed is not None else self._rng.getrandbits(62))
        answer = self._add(request_id, tokens, params) if self.replica.leads else None
        # its own task, which a caller that gives up does not cancel: the replica's other ranks still get the answer
        shared = asyncio.ensure_future(self.replica.share_answer(request_id, answer))
        self._asked.add(request_id)
        shared.add_done_callback(lambda _: self._asked.discard(request_id))
        try:
            return await asyncio.shield(shared)
        except asyncio.CancelledError:      # the caller gave up on it: free its slot in the engine
            self.abort(request_id)
            raise

    def _add(self, request_id: str, tokens: list[int], params: dict) -> asyncio.Future:
        """Queues the request; the first one queued sends them all once every request issued beside it (in this turn
        of the event loop) is queued too."""
        loop = asyncio.get_running_loop()
        # SGLang aborts every request whose id starts with the aborted one's: its own ids are all of one length
        request = _Request(request_id, uuid.uuid4().hex, list(tokens), params, loop.create_future(), self.version)
        self._in_flight[request_id] = request
        self._unsent.append(request)
        if len(self._unsent) == 1:
            task = loop.create_task(self._send_unsent())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return request.done

    async def _send_unsent(self) -> None:
        """The queued requests go to the engine in one batch, as one ``engine.generate`` call of them would: SGLang's
        scheduler then takes them in together, in one prefill batch, in order (sent one by one, it may wake between
        two and schedule them in two batches, which changes what CPU sampling draws for each). Streamed, so that each
        gets its completion as soon as it finishes; ``stream_interval`` keeps that to two messages a request."""
        batch, self._unsent = self._unsent, []
        if not batch:       # all aborted before they were sent
            return
        by_rid = {r.rid: r for r in batch}
        try:
            stream = await self.engine.async_generate(input_ids=[r.tokens for r in batch],
                                                      sampling_params=[r.params for r in batch],
                                                      rid=[r.rid for r in batch], return_logprob=True, stream=True,
                                                      return_routed_experts=self._hf_config is not None)
            async for out in stream:
                if out["meta_info"]["finish_reason"] is not None:
                    self._finish(by_rid[out["meta_info"]["id"]], out)
        except Exception as error:          # every waiting caller hears of it, none hangs
            for request in batch:
                self._settle(request, error=error)
        for request in batch:
            self._settle(request, error=RuntimeError(f"SGLang ended request {request.request_id!r} without an answer"))

    def _finish(self, request: _Request, out: dict) -> None:
        meta = out["meta_info"]
        reason = meta["finish_reason"]
        if reason.get("type") == "abort" and reason.get("status_code"):    # SGLang refused it: not an abort of ours
            self._settle(request, error=RuntimeError(f"SGLang refused request {request.request_id!r}: "
                                                     f"{reason.get('message')}"))
            return
        tokens = list(out["output_ids"])
        routes = None
        if self._hf_config is not None and tokens:     # none sampled (aborted early): no route to replay
            try:
                routes = routes_of(meta.get("routed_experts"), len(request.tokens) + len(tokens) - 1, self._hf_config)
            except (RuntimeError, ValueError) as error:
                self._settle(request, error=RuntimeError(f"request {request.request_id!r}: {error}"))
                return
        self._settle(request, tokens, [lp for lp, _, _ in meta["output_token_logprobs"]], finish_reason(reason),
                     routes=routes)

    def _settle(self, request: _Request, tokens: list[int] | None = None, logprobs: list[float] | None = None,
                reason: str = "", error: Exception | None = None, routes: torch.Tensor | None = None) -> None:
        """Hands the request its completion (or ``error``); the first settlement wins."""
        if self._in_flight.get(request.request_id) is not request:
            return
        del self._in_flight[request.request_id]
        if request.done.done():
            return
        if error is not None:
            request.done.set_exception(error)
        else:
            request.done.set_result(Completion(request.request_id, tokens or [], logprobs or [], reason,
                                               (request.version, self.version), routes))

    def abort(self, request_id: str) -> None:
        request = self._in_flight.get(request_id)
        if request is None:
            return
        if request in self._unsent:         # never reached the engine
            self._unsent.remove(request)
            self._settle(request, reason="abort")
        else:                               # the engine finishes it at its next step, with its tokens so far
            self.engine.tokenizer_manager.abort_request(rid=request.rid)

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

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Hands the stream to the engine bucket by bucket (at most ``BUCKET_BYTES`` each, as shared-memory tensors)
        inside one weight-update session, and flushes the prefix cache in it so no KV computed with the old weights
        is reused. A rank without an engine still pulls the stream: the exchange behind it is collective. (SGLang
        holds the update until the requests in flight have finished.)"""
        if not self.replica.leads:
            for _ in named_tensors:
                pass
            self.version = version
            return
        check_result(self.engine.begin_weight_update(), "begin_weight_update")
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
            check_result(self.engine.end_weight_update(), "end_weight_update")
        self.version = version

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not torch.cuda.is_available():
            bucket = in_shared_memory(bucket)
        check_result(self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
               "update_weights_from_tensor")

    def release_memory(self) -> None:
        if self.replica.leads:
            check_result(self.engine.release_memory_occupation(tags=self._memory_tags), "release_memory_occupation")
            self._released = list(self._memory_tags)

    def resume_memory(self, what: str) -> None:
        """``"weights"`` before a push, ``"kv_cache"`` (with its CUDA graphs) before generating."""
        tags = [t for t in self._released if (t == "weights") == (what == "weights")]
        if self.replica.leads and tags:
            check_result(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
            self._released = [t for t in self._released if t not in tags]

    def flush_cache(self, timeout: float = 30.0) -> None:
        """Empties the prefix cache, inside a weight-update session: an empty update that flushes. (``Engine.
        flush_cache`` also runs a ``gc.collect()`` in the scheduler, 0.43 s of a 0.44 s sync on CPU; this takes
        2 ms.) SGLang refuses a flush while requests are still being retired; retried until it takes."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.engine.update_weights_from_tensor(named_tensors=[], flush_cache=True)
            success, message = outcome(result)
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


class _LoopFromAnyThread:
    """The engine's event loop as its blocking methods (weight updates, ``score``'s generate) use it: they call
    ``run_until_complete`` on the loop the engine was built on. When that loop is running on another thread (an
    async-mode rollout worker's actor loop, which calls them from a worker thread), the coroutine is handed to it
    instead, and the caller waits for the result."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def run_until_complete(self, awaitable):
        if not self.loop.is_running():
            return self.loop.run_until_complete(awaitable)

        async def wait():
            return await awaitable
        return asyncio.run_coroutine_threadsafe(wait(), self.loop).result()

    def __getattr__(self, name: str):
        return getattr(self.loop, name)


@dataclass
class _Request:
    request_id: str             # the caller's
    rid: str                    # SGLang's
    tokens: list[int]
    params: dict
    done: asyncio.Future
    version: int                # the weights its first token was sampled with
