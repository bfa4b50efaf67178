"""One decode step's choice of token for each request in the batch, each by its own ``Sampling``: temperature, then
top-k, then top-p (vLLM's order), drawn with the request's own generator so that its sample does not depend on the
rows beside it. The logprobs are the sampling policy's, as vLLM's processed logprobs are."""
from __future__ import annotations

from typing import Sequence

import torch

from rlcore.specs import Sampling


def check_sampling(sampling: Sampling) -> None:
    """Refuse, in one line, what this backend would otherwise sample wrongly."""
    if sampling.max_tokens < 1:
        raise ValueError(f"Sampling.max_tokens must be at least 1 (got {sampling.max_tokens})")
    if sampling.temperature < 0:
        raise ValueError(f"Sampling.temperature must be >= 0, 0 for greedy (got {sampling.temperature})")
    if sampling.top_k == 0 or sampling.top_k < -1:
        raise ValueError(f"Sampling.top_k must be -1 (off) or at least 1 (got {sampling.top_k})")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"Sampling.top_p must be in (0, 1], 1 for off (got {sampling.top_p})")
    if not 0 <= sampling.min_tokens <= sampling.max_tokens:
        raise ValueError(f"Sampling.min_tokens must be in [0, max_tokens={sampling.max_tokens}] "
                         f"(got {sampling.min_tokens})")


def pick(logits: torch.Tensor, samplings: Sequence[Sampling], generators: Sequence[torch.Generator],
         banned: Sequence[Sequence[int]] = ()) -> list[tuple[int, float]]:
    """A (token, logprob) per row of the last position's ``logits`` [b, V]. Greedy rows (temperature 0) take the
    argmax, with the logprob of log_softmax(logits). ``banned[row]``: tokens the row may not sample now (eos and
    the stop ids before its ``min_tokens``), taken out before anything else, as vLLM's min-tokens processor does."""
    temperatures = torch.tensor([s.temperature or 1.0 for s in samplings], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperatures[:, None]
    for row, tokens in enumerate(banned):
        scaled[row, list(tokens)] = -torch.inf
    logp = torch.log_softmax(scaled, -1)
    picked = []
    for row, (sampling, generator) in enumerate(zip(samplings, generators)):
        if sampling.temperature == 0:
            token = int(logp[row].argmax())
        else:
            if sampling.top_k != -1 or sampling.top_p < 1:
                logp[row] = torch.log_softmax(_truncate(scaled[row], sampling.top_k, sampling.top_p), -1)
            token = int(torch.multinomial(logp[row].exp(), 1, generator=generator))
        picked.append((token, logp[row, token].item()))
    return picked


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` [V] with every token outside the top ``top_k`` and outside the smallest set of most likely tokens
    whose probability reaches ``top_p`` set to -inf (ties at the k-th kept)."""
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -torch.inf)
    if top_p < 1:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= top_p      # the tokens ranked above it already reach top_p
        logits = logits.clone()
        logits[order[beyond]] = -torch.inf
    return logits
