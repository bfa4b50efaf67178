"""An in-process vLLM engine as an rlcore RolloutBackend.

Requests go to vLLM's own scheduler (``LLMEngine.add_request``); one task steps the engine while any is in flight,
handing each request its new tokens as they come (vLLM's delta outputs), so an aborted request returns what it had
sampled. Every rank of a tensor-parallel engine (external launcher) must add the same requests in the same order:
the colocated source gives each rank of a replica the same prompts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from rlcore.hf_config import read_config_json
from rlcore.rollout.in_flight import InFlight
from rlcore.specs import Completion, RolloutBackend, Sampling
from rlcore_rollout_vllm.processed import ProcessedPrompts

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import EngineCoreRequest
    from vllm.logprobs import PromptLogprobs, SampleLogprobs

log = logging.getLogger(__name__)


class VLLMRollout(RolloutBackend):
    can_release_memory = False  # the CPU build has no sleep mode; set per platform in __init__
    _adapters: ServedAdapter | None = None   # with lora_rank: the LoRA adapter it serves

    def __init__(self, model_path: str, cfg, seed: int = 0, max_model_len: int | None = None,
                 distributed: bool = False, load_weights: bool = True, lora_rank: int = 0,
                 routed_experts: bool = False):
        """``distributed``: every trainer rank hosts its shard of an engine whose tensor-parallel groups are
        consecutive ranks (``rollout.tp`` each), over the trainer's torch.distributed world (external launcher).
        ``load_weights=False``: placeholder weights until the first push (vLLM's dummy load format).
        ``lora_rank``: serve LoRA adapters of this rank (``load_adapters``), one at a time.
        ``routed_experts``: every completion carries the experts each MoE layer routed its tokens to
        (``Completion.routed_experts``; vLLM's ``enable_return_routed_experts``, which needs its V2 model runner:
        GPU builds only, the CPU build refuses it at start)."""
        # The engine runs in this process, so tensors pass to it directly. On CPU it then also binds this
        # process's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) and turns torch.set_num_threads into a no-op.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cfg.tp > 1 and not distributed:
            raise ValueError(f"rollout.backend=vllm hosts rollout.tp={cfg.tp} only colocated (each trainer rank its "
                             f"shard, vLLM's external launcher), not in one async rollout worker yet: use rollout.tp=1 "
                             f"and more rollout.world_size, or rollout.backend=sglang")
        from vllm import LLM

        if distributed and not torch.cuda.is_available():
            from rlcore_rollout_vllm.cpu_shm_names import run_scoped_shm_names

            run_scoped_shm_names()
        if not torch.cuda.is_available():
            from rlcore_rollout_vllm.cpu_eager_ranks import eager_token_ranks

            eager_token_ranks()
        # on CPU a seeded request whose prefill is split over engine steps fails (vLLM 0.32 rewinds the request's
        # generator, which a CPU generator cannot; many multi-turn requests at once split them): prefills run whole
        options: dict[str, Any] = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}
        if distributed:
            options.update(tensor_parallel_size=cfg.tp, distributed_executor_backend="external_launcher")
        self._adapters = ServedAdapter() if lora_rank else None
        if lora_rank:
            options.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(lora_rank), max_loras=1)
        self._hf_config = read_config_json(model_path) if routed_experts else None
        if routed_experts:
            options["enable_return_routed_experts"] = True
        self.image_token_id = _image_token_id(model_path)
        if self.image_token_id is not None:
            options.update(limit_mm_per_prompt={"image": cfg.limit_images, "video": 0})
        self.llm = LLM(model=model_path, dtype="float32" if not torch.cuda.is_available() else "auto",
                       enforce_eager=not torch.cuda.is_available(), seed=seed, max_model_len=max_model_len,
                       kv_cache_memory_bytes=int(cfg.kv_cache_gib * (1 << 30)), enable_sleep_mode=False,
                       logprobs_mode="processed_logprobs",  # after temperature: the policy actually sampled
                       load_format="auto" if load_weights else "dummy", **options)
        self.seed = seed
        self._in_flight = InFlight()
        self._processed = ProcessedPrompts()
        if not torch.cuda.is_available():
            from rlcore_rollout_vllm.cpu_moe_reload import repack_moe_on_reload

            repack_moe_on_reload(self._worker().get_model())

    def _worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    async def generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str) -> Completion:
        lora = self._lora_request()
        request = self._processed.request(
            request_id, (tuple(tokens), sampling, lora and lora.lora_int_id), seed,
            lambda: self._process(_token_prompts([tokens])[0], sampling, seed, request_id))
        return await self._submit(request, len(tokens))

    async def generate_with_images(self, tokens: list[int], images: Sequence[Any], sampling: Sampling,
                                   seed: int | None, request_id: str) -> Completion:
        prompt = self._image_prompts([tokens], [images])[0]
        return await self._submit(self._process(prompt, sampling, seed, request_id), len(tokens))

    def _process(self, prompt: TokensPrompt, sampling: Sampling, seed: int | None,
                 request_id: str) -> EngineCoreRequest:
        """The request as vLLM's input processing makes it (what ``add_request`` would do with ``prompt``)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # vLLM clamps a logit bias to [-100, 100]: a banned token keeps a probability of e^-100 at most
        banned = {token: -100.0 for token in sampling.banned_token_ids} or None
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids),
                                min_tokens=sampling.min_tokens, logprobs=0, seed=seed, detokenize=False,
                                logit_bias=banned, output_kind=RequestOutputKind.DELTA,
                                skip_clone=True)    # made for this request alone: vLLM's deep copy of it is waste
        engine = self.llm.llm_engine
        return engine.input_processor.process_inputs(request_id, prompt, params,
                                                     supported_tasks=engine.get_supported_tasks(),
                                                     lora_request=self._lora_request())

    async def _submit(self, request: EngineCoreRequest, prompt_length: int) -> Completion:
        """``prompt_length``: the prompt's tokens as the trained model sees them (an image's placeholders
        expanded, as vLLM expands them), which its routed experts cover."""
        request_id = request.request_id
        submit = lambda: self.llm.llm_engine.add_request(request_id, request,  # noqa: E731
                                                         request.sampling_params)
        return await self._in_flight.run(request_id, self.version, submit, self._step_while_busy, self.abort,
                                         extra=prompt_length)

    def _image_prompts(self, sequences: Sequence[list[int]], images: Sequence[Sequence[Any]]) -> list[TokensPrompt]:
        """vLLM expands each image's one placeholder into as many as its processor makes: the trained model's run
        of placeholders goes in as one (passed whole, vLLM would take it for that many images' worth, silently)."""
        if self.image_token_id is None:
            raise ValueError("images were given to a vLLM engine whose model's config.json has no image_token_id: "
                             "not a vision-language checkpoint")
        prompts = _token_prompts([_one_placeholder_per_image(s, self.image_token_id) for s in sequences])
        for prompt, own in zip(prompts, images):
            if own:
                prompt["multi_modal_data"] = {"image": list(own)}
        return prompts

    async def _step_while_busy(self) -> None:
        """Step the engine while requests are in flight, yielding between steps (to new requests and aborts)."""
        from vllm import RequestOutput

        while self._in_flight:
            for out in self.llm.llm_engine.step():
                request = self._in_flight.get(out.request_id)
                if request is None or not isinstance(out, RequestOutput):
                    continue
                delta = out.outputs[0]
                request.tokens += delta.token_ids
                request.logprobs += _token_logprobs(delta.logprobs, delta.token_ids)
                if out.finished and self._hf_config is not None and request.tokens:
                    request.routed_experts = routes_of(delta.routed_experts, request.extra + len(request.tokens) - 1,
                                                       self._hf_config)
                if out.finished:
                    self._in_flight.finish(out.request_id, delta.finish_reason or "", self.version)
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        request = self._in_flight.get(request_id)
        if request is not None:
            if self._hf_config is not None and request.tokens:
                try:
                    request.routed_experts = routes_of(self._routes_so_far(request_id),
                                                       request.extra + len(request.tokens) - 1, self._hf_config)
                except (RuntimeError, AttributeError, KeyError) as error:
                    # vLLM's internals moved, or it has no rows yet: the aborted part goes without routes
                    log.warning("aborted request %r keeps no routed experts: %s", request_id, error)
            self.llm.llm_engine.abort_request([request_id])
            self._in_flight.finish(request_id, "abort", self.version)

    def _routes_so_far(self, request_id: str):
        """The routed experts of a request in flight, for the tokens fed so far: vLLM 0.32 keeps them in its output
        processor's request state (``routed_experts_chunks``, one per step) and hands them over only on a finished
        request's final output, which an in-process engine does not make for an aborted one. None if it has none."""
        import numpy as np

        processor = self.llm.llm_engine.output_processor
        chunks = [chunk for internal in processor.external_req_ids.get(request_id, ())
                  if (state := processor.request_states.get(internal)) is not None
                  for chunk in state.routed_experts_chunks]
        return np.concatenate(chunks) if chunks else None

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        return self._score(_token_prompts(sequences), sequences, start)

    def score_with_images(self, sequences: Sequence[list[int]], start: Sequence[int],
                          images: Sequence[Sequence[Any]]) -> list[list[float]]:
        """The logprobs come at the expanded prompt's positions, which are ``sequences``' own."""
        return self._score(self._image_prompts(sequences, images), sequences, start)

    def _score(self, prompts: list[TokensPrompt], sequences: Sequence[list[int]],
               start: Sequence[int]) -> list[list[float]]:
        from vllm import SamplingParams

        if self._in_flight:     # LLM.generate would step the engine and take their outputs
            raise RuntimeError(f"score() with {len(self._in_flight)} requests in flight; score between generations")

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        lora = self._lora_request()
        if self._adapters is not None and not torch.cuda.is_available():
            # vLLM 0.32's CPU LoRA (PunicaWrapperCPU.add_lora_logits) indexes a request's prompt-logprob rows by the
            # batch's requests: with LoRA on, prompt logprobs of several sequences at once fail ("einsum(): subscript
            # b has size 8 ... with previously seen size 11"); one sequence per call
            outputs = [self.llm.generate([p], params, use_tqdm=False, lora_request=lora)[0] for p in prompts]
        else:
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        return [_token_logprobs(o.prompt_logprobs, s, st) for o, s, st in zip(outputs, sequences, start)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._worker().reload_weights(weights_iterator=iter(named_tensors))
        self.llm.reset_prefix_cache()
        if self.image_token_id is not None:
            # the image embeddings vLLM cached (keyed by the image) came from the old vision tower; the engine's
            # reset clears the scheduler's record of them too (the worker's alone: "Encoder cache miss")
            self.llm.llm_engine.reset_encoder_cache()
        self.version = version

    def load_adapters(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """vLLM loads an adapter from a PEFT directory: written to shared memory (RAM), added under a new id, the old
        one removed (``max_loras=1``: one adapter's memory)."""
        if self._adapters is None:
            raise RuntimeError("load_adapters on a vLLM engine started without LoRA (lora_rank=0)")
        engine = self.llm.llm_engine
        new, old = self._adapters.write(tensors, config, version)
        if old is not None:
            engine.remove_lora(old.lora_int_id)
        if not engine.add_lora(new):
            raise RuntimeError(f"vLLM did not load the LoRA adapter of weights version {version} ({new.lora_path})")
        self._adapters.served(new, old)
        self.llm.reset_prefix_cache()
        self.version = version

    def _lora_request(self):
        return None if self._adapters is None else self._adapters.request

    def stop(self) -> None:
        llm = vars(self).pop("llm", None)       # idempotent
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if self._adapters is not None:
            self._adapters.close()


class ServedAdapter:
    """The adapter a vLLM engine serves, as the PEFT directory vLLM reads (in /dev/shm where there is one: RAM, no
    disk), one per version; the LoRA id is the version + 1 (vLLM's ids start at 1)."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="rlcore-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.request: LoRARequest | None = None

    def write(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> tuple[LoRARequest,
                                                                                           LoRARequest | None]:
        """(the new version's request, the one served now)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from rlcore.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        path = os.path.join(self.root, f"v{version}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        # safetensors refuses tensors that share memory (q/k/v_proj share their A): each its own copy
        save_file({name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()},
                  os.path.join(path, ADAPTER_WEIGHTS))
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f)
        return LoRARequest(f"rlcore-v{version}", version + 1, path, load_inplace=True), self.request

    def served(self, new: LoRARequest, old: LoRARequest | None) -> None:
        self.request = new
        if old is not None and old.lora_path != new.lora_path:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _vllm_lora_rank(rank: int) -> int:
    """vLLM sizes its LoRA buffers for one of a few ranks (``MaxLoRARanks``): the smallest that holds ``rank``."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"actor.lora.rank = {rank}: vLLM serves LoRA adapters up to rank {allowed[-1]}; use a "
                         f"smaller rank or rollout.lora=merged")
    return fits[0]


def routes_of(rows, tokens_fed: int, hf_config: dict) -> torch.Tensor:
    """A request's routed experts as a completion carries them (``rlcore.routed_experts``), from vLLM's: the final
    ``CompletionOutput.routed_experts``, a numpy array [tokens fed, every decoder layer, top_k] (the prompt and every
    sampled token but the last; uint8 up to 256 experts, else uint16; dense layers' rows are zeros), or the chunks
    an aborted request had concatenated (``_routes_so_far``)."""
    from rlcore.routed_experts import from_engine

    if rows is None:
        raise RuntimeError(f"vLLM returned no routed experts for {tokens_fed} tokens fed although asked "
                           f"(enable_return_routed_experts)")
    if len(rows) != tokens_fed:
        raise RuntimeError(f"vLLM returned routed experts for {len(rows)} tokens, {tokens_fed} were fed (prompt + "
                           f"response - 1)")
    return from_engine(rows, hf_config)



def _image_token_id(model_path: str) -> int | None:
    """The checkpoint's image placeholder (a vision-language model's config.json has one), else None."""
    try:
        config = read_config_json(model_path)
    except OSError:
        return None
    return config.get("image_token_id") if "vision_config" in config else None


def _one_placeholder_per_image(tokens: Sequence[int], placeholder: int) -> list[int]:
    return [t for i, t in enumerate(tokens) if t != placeholder or i == 0 or tokens[i - 1] != placeholder]


def _token_prompts(sequences: Sequence[list[int]]) -> list[TokensPrompt]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]


def _token_logprobs(positions: PromptLogprobs | SampleLogprobs | None, tokens: Sequence[int],
                    start: int = 0) -> list[float]:
    """The logprob of ``tokens[j]`` at each position j from ``start`` on, from what vLLM returned when asked for
    ``logprobs=0`` (sampled tokens) or ``prompt_logprobs=0`` (prompt tokens; position 0 has none)."""
    if positions is None:
        raise RuntimeError("vLLM returned no logprobs although SamplingParams asked for them")
    logprobs = []
    for j in range(start, len(tokens)):
        at = positions[j]
        if at is None:
            raise RuntimeError(f"vLLM has no logprob at position {j} (a prompt's first token has none)")
        logprobs.append(at[tokens[j]].logprob)
    return logprobs
