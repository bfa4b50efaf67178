"""The rollout contract's setting (``rlcore_testing.rollout`` holds its checks): the backend under test, built as a
run builds it (``RegisteredBackend``); a tiny random Qwen3 checkpoint and transformers on it, the reference for every
number; and prompts whose greedy continuations are decided by a clear margin (``build_contract``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rlcore.specs import RolloutBackend, RolloutBackendSpec

# fp32 on CPU, the largest difference from transformers' logprobs over all the checks, measured: vLLM 3.5e-7, SGLang
# 4.8e-7, transformers' backend 3.6e-7 (batched with left padding); T = 1's logprobs are 0.13-0.17 from T = 0.7's
LOGPROB_TOLERANCE = 2e-6
TEMPERATURE = 0.7
MAX_TOKENS = 8
MAX_MODEL_LEN = 128
GREEDY_MARGIN = 1e-2        # the chosen prompts' greedy steps win by this much (logprob), so no backend can flip one
LONG_TOKENS = 32            # the aborted request's budget: the length prompt's greedy run has no eos within it

Factory = Callable[[str], RolloutBackend]


def contract_hf_config() -> dict:
    """The tiny Qwen3 every backend runs (the qwen3 plugin's config, so it is the architecture rlcore trains)."""
    from rlcore.plugins import load_plugins

    spec = load_plugins(["qwen3"]).registry.get("models", "qwen3")
    return spec.tiny_hf_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                               ffn_hidden_size=128, max_position_embeddings=256)


@dataclass(frozen=True)
class RegisteredBackend:
    """A picklable factory: the backend registered as ``name`` by plugin ``plugin`` (default: the same name), built
    the way the trainer builds it (one process, rollout.tp=1, a small KV cache; ``routed_experts``: passed to the
    factory, as a run with ``actor.moe.routing_replay=rollout`` does)."""
    name: str
    plugin: str = ""
    kv_cache_gib: float = 0.01
    max_model_len: int = MAX_MODEL_LEN
    routed_experts: bool = False

    def spec(self) -> RolloutBackendSpec:
        from rlcore.plugins import load_plugins

        return load_plugins([self.plugin or self.name]).registry.get("rollout_backends", self.name)

    def __call__(self, model_path: str) -> RolloutBackend:
        from rlcore.config.schema import RolloutConfig

        cfg = RolloutConfig(backend=self.name, kv_cache_gib=self.kv_cache_gib, tp=1)
        routes = {"routed_experts": True} if self.routed_experts else {}
        return self.spec().factory(model_path, cfg, seed=0, max_model_len=self.max_model_len, distributed=False,
                                   **routes)


# --------------------------------------------------------------------------------------------------------------------
# The reference: transformers on the same checkpoint.

def write_word_tokenizer(path: str, vocab_size: int, eos_token_id: int) -> None:
    """A one-word-per-id tokenizer: vLLM loads a tokenizer even when fed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"t{i}" for i in range(vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[eos_token_id]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = words[eos_token_id]
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos).save_pretrained(path)


def reference_logprobs(model, sequence: Sequence[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """transformers' log_softmax(logits / T) [len - start, vocab] predicting ``sequence[j]`` for j >= start."""
    with torch.no_grad():
        logits = model(torch.tensor([list(sequence)])).logits[0].double()
    return torch.log_softmax(logits[start - 1:len(sequence) - 1] / temperature, -1)


def greedy_continuation(model, prompt: list[int], max_tokens: int, eos: int) -> tuple[list[int], float]:
    """transformers' greedy continuation (up to and including eos) and its smallest top-1 / top-2 logprob gap."""
    tokens: list[int] = []
    margin = math.inf
    for _ in range(max_tokens):
        logp = reference_logprobs(model, prompt + tokens + [0], len(prompt) + len(tokens))[-1]
        top = logp.topk(2).values
        margin = min(margin, (top[0] - top[1]).item())
        tokens.append(int(logp.argmax()))
        if tokens[-1] == eos:
            break
    return tokens, margin


def _pick_prompts(model, vocab_size: int, eos: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation reaches eos after a few tokens, and one that runs to MAX_TOKENS, both with
    every step decided by at least GREEDY_MARGIN; the second has no eos within LONG_TOKENS either."""
    g = torch.Generator().manual_seed(0)
    stop = length = None
    for _ in range(400):
        prompt = torch.randint(1, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        tokens, margin = greedy_continuation(model, prompt, MAX_TOKENS, eos)
        if margin < GREEDY_MARGIN:
            continue
        if stop is None and tokens[-1] == eos and 2 <= len(tokens) < MAX_TOKENS:
            stop = prompt
        elif length is None and eos not in tokens and \
                eos not in greedy_continuation(model, prompt, LONG_TOKENS, eos)[0]:
            length = prompt
        if stop and length:
            return stop, length
    raise RuntimeError("no prompt of the contract's checkpoint ends greedily at eos (or none runs to the end)")


@dataclass
class Contract:
    """What the checks share: the engine under test, transformers on the same checkpoint, prompts."""
    engine: RolloutBackend
    reference: Any                  # transformers' model of the checkpoint
    path: str
    hf_config: dict
    eos: int
    stop_prompt: list[int]          # greedy: reaches eos after 2..MAX_TOKENS-1 tokens
    length_prompt: list[int]        # greedy: no eos within MAX_TOKENS
    prompts: list[list[int]]        # the two above and one more, of three lengths
    tolerance: float


def build_contract(factory: Factory, path: str, tolerance: float = LOGPROB_TOLERANCE,
                   hf_config: dict | None = None) -> Contract:
    """Writes the checkpoint (and a tokenizer) to ``path``, picks the prompts, starts the engine."""
    from rlcore_testing.models import write_checkpoint

    hf_config = hf_config or contract_hf_config()
    reference = write_checkpoint(hf_config, path)
    eos = hf_config["eos_token_id"]
    write_word_tokenizer(path, hf_config["vocab_size"], eos)
    stop, length = _pick_prompts(reference, hf_config["vocab_size"], eos)
    prompts = [stop, length, [7, 3, 11, 5, 2, 9, 4]]
    return Contract(factory(path), reference, path, hf_config, eos, stop, length, prompts, tolerance)
