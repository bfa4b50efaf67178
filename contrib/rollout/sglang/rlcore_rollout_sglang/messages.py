"""What passes between rlcore and SGLang's engine, translated: its KV cache size, a request's sampling parameters, a
weight bucket in shared memory its scheduler can receive, a finished request's finish reason and routed experts, and
the outcome of its calls."""
from __future__ import annotations

from typing import Any

import torch

from rlcore.hf_config import read_config_json
from rlcore.specs import Sampling


def sampling_params(sampling: Sampling, seed: int) -> dict:
    """SGLang's sampling parameters for one request. ``stream_interval``: a streamed request's first token is sent
    at once, the rest when it finishes."""
    params: dict[str, Any] = {"n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p,
                              "top_k": sampling.top_k, "max_new_tokens": sampling.max_tokens, "sampling_seed": seed,
                              "stream_interval": sampling.max_tokens}
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.min_tokens:
        raise ValueError(f"rollout.backend=sglang cannot honour Sampling.min_tokens={sampling.min_tokens}: SGLang "
                         f"0.5.23 needs its tokenizer for min_new_tokens and rlcore runs it without one "
                         f"(skip_tokenizer_init); ask without min_tokens, or use rollout.backend=vllm or hf")
    return params


def in_shared_memory(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
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


def routes_of(encoded: Any, tokens_fed: int, hf_config: dict) -> torch.Tensor:
    """A finished request's routed experts as a completion carries them (``rlcore.routed_experts``), from SGLang's
    ``meta_info["routed_experts"]``: base64 of int32 [tokens fed, every decoder layer, top_k] (dense layers' rows are
    zeros), for the prompt and every sampled token but the last."""
    import base64

    import numpy as np

    from rlcore.routed_experts import from_engine

    if encoded is None:
        raise RuntimeError(f"SGLang returned no routed experts for {tokens_fed} tokens fed although asked")
    hf = hf_config.get("text_config") or hf_config
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_token = hf["num_hidden_layers"] * hf["num_experts_per_tok"]
    if flat.size != tokens_fed * per_token:
        raise RuntimeError(f"SGLang returned {flat.size / per_token:g} tokens' routed experts for {tokens_fed} tokens "
                           f"fed ({hf['num_hidden_layers']} layers x top {hf['num_experts_per_tok']} each)")
    return from_engine(flat.reshape(tokens_fed, hf["num_hidden_layers"], hf["num_experts_per_tok"]), hf_config)



def finish_reason(reason: dict | None) -> str:
    """SGLang's ``{"type": "stop"|"length"|"abort", ...}`` as vLLM's finish reason string."""
    return (reason or {}).get("type", "")


def outcome(result: Any) -> tuple[bool, str]:
    """SGLang's calls answer ``(success, message)`` or an object with both."""
    return (result.success, result.message) if hasattr(result, "success") else (result[0], result[1])


def check_result(result: Any, what: str) -> None:
    success, message = outcome(result)
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def kv_cache_tokens(model_path: str, gib: float) -> int:
    """Tokens of KV cache that ``gib`` GiB hold for the checkpoint at ``model_path`` (fp32 on CPU)."""
    hf = read_config_json(model_path)
    heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * heads * head_dim * 4
    return max(1024, int(gib * (1 << 30)) // per_token)
