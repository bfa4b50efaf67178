"""The rollout-backend contract: what rlcore asks of every ``RolloutBackend``, per request, checked against
transformers.

The checks are here; ``rlcore_testing.rollout_pytest`` runs them as tests. A backend's test module gets the whole
contract as a class (``contrib/rollout/*/tests/test_*_contract.py``)::

    from rlcore_testing.contract import RegisteredBackend
    from rlcore_testing.rollout_pytest import RolloutContract

    class TestVLLMContract(RolloutContract):
        factory = RegisteredBackend("vllm")
        in_subprocess = True
        limitations = {"seeds_reproduce_samples": "why, and what would lift it"}       # strict xfails
        not_applicable = {"release_and_resume_memory": "what the backend does not do here"}   # not collected

The setting (the backend built as a run builds it, the checkpoint, its reference, the prompts) is
``rlcore_testing.contract``'s. One engine serves the class (an engine start is the expensive part). It is built by
the backend's registered factory, as a run builds it, from a tiny random Qwen3 checkpoint (fp32; head_dim 32, the
smallest vLLM's CPU attention takes) that transformers also loads: transformers is the reference for every number. With
``in_subprocess`` the engine, the reference and the checks live in a spawned child process (vLLM allows one
in-process engine per process) and each test asks it to run one check. Requests go to the engine concurrently, as
``rlcore.rollout.requests.sample`` sends a batch; the checks, each a test named ``test_<check>``:

- ``generate_shapes``: a completion per request, with its request id and the engine's weight version; one logprob
  (finite, <= 0) per token; a finish reason that fits the tokens ("stop": ends with eos, eos nowhere else;
  "length": ``max_tokens`` tokens, no eos); the ``n`` samples of a prompt are not one sample repeated;
- ``finish_reasons``: greedy decoding stops at eos ("stop", eos included) where transformers' greedy continuation
  reaches it, and runs to ``max_tokens`` ("length") where it does not (prompts picked so that every greedy step
  wins by a clear margin); ``stop_token_ids``: a stop id ends the response there, kept as its last token;
- ``abort``: a request aborted in flight returns the tokens it had (a prefix of its unaborted run, with their
  logprobs), finish reason "abort", while a request beside it finishes unharmed; aborting an unknown id is no error;
- ``seeds_reproduce_samples``: a request's sample depends on its seed only, not on the other requests in flight or
  their order; ``different_seeds_differ``;
- ``logprobs_after_temperature``: sampled tokens' logprobs are log_softmax(logits / T) of transformers (within
  ``tolerance``) and far from T = 1's;
- ``greedy_equals_score``: at T = 0 each token is transformers' argmax (up to ``tolerance``), and its logprob equals
  the teacher-forced ``score`` and transformers' log_softmax(logits);
- ``score_from_any_start``: ``score`` from starts 1, mid and last equals transformers;
  ``score_refuses_the_first_token``: start 0 raises (ValueError or RuntimeError), as no logprob exists there;
- ``update_weights``: pushing other weights (``rlcore_testing.models.random_hf_state``, as a stream) as a new version
  changes the outputs, which then equal transformers on those weights and report that version; pushing the
  checkpoint back restores the first outputs;
- ``release_and_resume_memory``: where ``can_release_memory``, the hybrid engine's order (release, resume weights,
  push, resume the KV cache) gives the same outputs as before (a backend's contract names it ``not_applicable``
  where it cannot);
- ``stop_is_idempotent``: ``stop()`` twice (the last check: it ends the module's engine);
- ``routed_experts`` (``rlcore_testing.routed_experts.ROUTED_EXPERTS_CHECKS``), on a contract of its own per tiny MoE
  model of ``MOE_MODELS`` (``RolloutContract.routed_experts_models``), the engine started with ``routed_experts=True``,
  for a backend whose ``RolloutBackendSpec.routed_experts`` names this machine's device type (skipped elsewhere):
  concurrent requests of several prompt lengths and budgets, one of them aborted, each return routes
  [len(prompt) + len(tokens) - 1, MoE layers, top_k] int16, every row ascending without a repeat, equal to
  transformers' routers on the sequence alone (unpadded, fp32: exactly); after a push of the same weights, the same
  routes again.

Known limitations of a backend are a table ``{check: reason}``: those checks become strict xfails, so the table
fails as soon as a limitation goes away (and naming a check that does not exist is an error).
"""
from __future__ import annotations

import asyncio
import math
from typing import Callable, Iterator, Sequence

import pytest
import torch

from rlcore.rollout.requests import run, sample
from rlcore.specs import Completion, Sampling
from rlcore_testing.contract import (LONG_TOKENS, MAX_TOKENS, TEMPERATURE, Contract, greedy_continuation,
                                     reference_logprobs)


def _taken(logp: torch.Tensor, tokens: Sequence[int]) -> list[float]:
    return logp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


# --------------------------------------------------------------------------------------------------------------------
# The checks. Each takes the Contract; RolloutContract turns them into tests.

def _sample(c: Contract, prompts: list[list[int]], n: int, temperature: float, max_tokens: int = MAX_TOKENS,
            seeds: list[int] | None = None) -> list[list[Completion]]:
    return sample(c.engine, prompts, n, Sampling(max_tokens, temperature), seeds)


def check_generate_shapes(c: Contract) -> None:
    """What the trainer indexes and masks by: a completion per request, a logprob per token, a finish reason, the
    weights that sampled it."""
    n = 4
    out = _sample(c, c.prompts, n, 1.0, seeds=[1, 2, 3])
    for i, samples in enumerate(out):
        for j, gen in enumerate(samples):
            assert isinstance(gen, Completion) and gen.request_id == f"sample-{i}-{j}", gen
            assert gen.versions == (c.engine.version, c.engine.version), (gen.versions, c.engine.version)
            assert all(isinstance(t, int) for t in gen.tokens), gen.tokens
            assert 1 <= len(gen.tokens) <= MAX_TOKENS and len(gen.logprobs) == len(gen.tokens), gen
            assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs), gen.logprobs
            _assert_finish_reason(gen, c.eos)
        assert len({tuple(g.tokens) for g in samples}) > 1, "the n samples of a prompt are one sample repeated"


def _assert_finish_reason(gen: Completion, eos: int) -> None:
    if gen.finish_reason == "stop":
        assert gen.tokens[-1] == eos and eos not in gen.tokens[:-1], gen
    else:
        assert gen.finish_reason == "length", f"finish reason {gen.finish_reason!r} (expected 'stop' or 'length')"
        assert len(gen.tokens) == MAX_TOKENS and eos not in gen.tokens, gen


def check_finish_reasons(c: Contract) -> None:
    """The reason must match where generation really ended: the reward and the masks depend on eos being there."""
    stop, length = _sample(c, [c.stop_prompt, c.length_prompt], 1, 0.0)
    expected, _ = greedy_continuation(c.reference, c.stop_prompt, MAX_TOKENS, c.eos)
    assert (stop[0].finish_reason, stop[0].tokens) == ("stop", expected), (stop[0], expected)
    assert length[0].finish_reason == "length" and len(length[0].tokens) == MAX_TOKENS, length[0]


def check_stop_token_ids(c: Contract) -> None:
    """A stop id ends the response where it is sampled, kept as its last token: how an agent stops at a tool call."""
    expected, _ = greedy_continuation(c.reference, c.length_prompt, MAX_TOKENS, c.eos)   # no eos within MAX_TOKENS
    stop_id = expected[2]
    greedy = Sampling(MAX_TOKENS, 0.0, stop_token_ids=(stop_id,))
    out = run(c.engine.generate(c.length_prompt, greedy, None, "stop-id"))
    assert (out.finish_reason, out.tokens) == ("stop", expected[:expected.index(stop_id) + 1]), (out, expected)


def check_min_tokens(c: Contract) -> None:
    """Before ``min_tokens`` eos is not sampled: greedy takes the runner-up where eos would have been, and the
    response runs on (how a workload asks for a response of a given length)."""
    expected, _ = greedy_continuation(c.reference, c.stop_prompt, MAX_TOKENS, c.eos)   # eos after 2..MAX_TOKENS-1
    out = run(c.engine.generate(c.stop_prompt, Sampling(MAX_TOKENS, 0.0, min_tokens=MAX_TOKENS), None, "min-tokens"))
    assert out.finish_reason == "length" and len(out.tokens) == MAX_TOKENS and c.eos not in out.tokens, out
    assert out.tokens[:len(expected) - 1] == expected[:-1], (out.tokens, expected)
    assert len(out.logprobs) == MAX_TOKENS and all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs), out


def check_abort(c: Contract) -> None:
    """An aborted request returns what it sampled until then, and the requests beside it are unharmed: how a run
    ends overlong or stale generations without losing them."""
    long, short = Sampling(LONG_TOKENS, 0.0), Sampling(MAX_TOKENS, 0.0)

    async def abort_beside_another():
        aborted = asyncio.ensure_future(c.engine.generate(c.length_prompt, long, None, "long"))
        finished = await c.engine.generate(c.stop_prompt, short, None, "short")
        c.engine.abort("long")
        c.engine.abort("no-such-request")
        return await aborted, finished

    aborted, finished = run(abort_beside_another())
    unaborted = run(c.engine.generate(c.length_prompt, long, None, "long-again"))
    expected, _ = greedy_continuation(c.reference, c.stop_prompt, MAX_TOKENS, c.eos)
    assert (finished.finish_reason, finished.tokens) == ("stop", expected), finished
    assert aborted.finish_reason == "abort" and len(aborted.tokens) < LONG_TOKENS, aborted
    assert unaborted.finish_reason == "length" and len(unaborted.tokens) == LONG_TOKENS, unaborted
    assert len(aborted.logprobs) == len(aborted.tokens)
    same = min(len(aborted.tokens), MAX_TOKENS)     # greedy steps decided by a clear margin: alike alone or beside
    assert aborted.tokens[:same] == unaborted.tokens[:same], (aborted.tokens, unaborted.tokens)
    assert _max_diff(aborted.logprobs[:same], unaborted.logprobs[:same]) < c.tolerance


def check_seeds_reproduce_samples(c: Contract) -> None:
    """A resumed run, or another split of prompts over engine replicas, samples the same."""
    a, b, other = c.prompts
    first = _sample(c, [a, b, other], 3, 1.0, seeds=[5, 6, 7])
    again = _sample(c, [other, [9, 8, 7, 6], a], 3, 1.0, seeds=[7, 11, 5])
    tokens = [[g.tokens for g in gens] for gens in first + again]
    assert tokens[0] == tokens[5] and tokens[2] == tokens[3], "a prompt's samples depend on more than its seed"


def check_different_seeds_differ(c: Contract) -> None:
    """Seeds are used, not collapsed into one stream start: otherwise every prompt would draw alike."""
    out = _sample(c, [c.prompts[2]] * 2, 3, 1.0, seeds=[1, 2])
    assert [g.tokens for g in out[0]] != [g.tokens for g in out[1]], "two seeds gave the same samples"


def check_logprobs_after_temperature(c: Contract) -> None:
    """The sampling policy's logprobs serve as the old policy (actor.old_logprobs=rollout) and in the mismatch
    metrics: they must be the actor's convention, log_softmax(logits / T)."""
    out = _sample(c, c.prompts, 2, TEMPERATURE, seeds=[1, 2, 3])
    worst = from_t1 = 0.0
    for prompt, samples in zip(c.prompts, out):
        for gen in samples:
            seq = prompt + gen.tokens
            worst = max(worst, _max_diff(gen.logprobs, _taken(reference_logprobs(c.reference, seq, len(prompt),
                                                                                 TEMPERATURE), gen.tokens)))
            from_t1 = max(from_t1, _max_diff(gen.logprobs, _taken(reference_logprobs(c.reference, seq, len(prompt)),
                                                                  gen.tokens)))
    print(f"sampled logprobs vs transformers at T={TEMPERATURE}: {worst:.1e} (at T=1: {from_t1:.1e})")
    assert worst < c.tolerance, f"sampled logprobs differ from transformers' log_softmax(logits/T) by {worst:.2e}"
    assert from_t1 > 100 * c.tolerance, f"sampled logprobs are within {from_t1:.1e} of T=1's: not after temperature"


def _assertgreedy(c: Contract, model, prompts: list[list[int]], out: list[list[Completion]]) -> float:
    """Every greedy token is ``model``'s argmax (up to the tolerance), its logprob the model's and ``score``'s."""
    scored = c.engine.score([p + o[0].tokens for p, o in zip(prompts, out)], [len(p) for p in prompts])
    worst = 0.0
    for prompt, o, s in zip(prompts, out, scored):
        gen = o[0]
        logp = reference_logprobs(model, prompt + gen.tokens, len(prompt))
        ref = _taken(logp, gen.tokens)
        short = (logp.max(-1).values - torch.tensor(ref, dtype=logp.dtype)).max().item()
        assert short < c.tolerance, f"a greedy token is {short:.2e} below transformers' argmax"
        worst = max(worst, _max_diff(gen.logprobs, ref), _max_diff(s, ref), _max_diff(gen.logprobs, s))
    assert worst < c.tolerance, f"greedy logprobs, score and transformers differ by {worst:.2e}"
    return worst


def check_greedy_equals_score(c: Contract) -> None:
    """Generation and teacher-forced scoring are one model: the engine check after a sync relies on score."""
    out = _sample(c, c.prompts, 1, 0.0)
    print(f"greedy logprobs / score vs transformers: {_assertgreedy(c, c.reference, c.prompts, out):.1e}")


def check_score_from_any_start(c: Contract) -> None:
    """score's windows start anywhere after the first token, several sequences in one call."""
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    starts = [1, len(seq) // 2, len(seq) - 1]
    scored = c.engine.score([seq] * len(starts) + c.prompts, starts + [1] * len(c.prompts))
    worst = 0.0
    for s, sequence, start in zip(scored, [seq] * len(starts) + c.prompts, starts + [1] * len(c.prompts)):
        worst = max(worst, _max_diff(s, _taken(reference_logprobs(c.reference, sequence, start), sequence[start:])))
    print(f"score vs transformers: {worst:.1e}")
    assert worst < c.tolerance, f"score differs from transformers by {worst:.2e}"


def check_score_refuses_the_first_token(c: Contract) -> None:
    """A sequence's first token has no logprob: asking for it must fail, not return another position's."""
    with pytest.raises((ValueError, RuntimeError)):
        c.engine.score([c.prompts[0]], [0])


def check_update_weights(c: Contract) -> None:
    """Every step's weight sync: a stream of full HF-named tensors replaces every weight, no stale KV is reused."""
    from transformers import AutoModelForCausalLM

    from rlcore_testing.models import random_hf_state

    new = random_hf_state(c.hf_config, scale=0.2, seed=1)
    before = _sample(c, c.prompts, 1, 0.0)
    version = c.engine.version + 1
    try:
        c.engine.update_weights(((name, tensor) for name, tensor in new.items()), version)   # a stream, as a sync's
        assert c.engine.version == version, f"the engine holds version {c.engine.version} after pushing {version}"
        after = _sample(c, c.prompts, 1, 0.0)
        assert [o[0].tokens for o in after] != [o[0].tokens for o in before], "outputs unchanged by new weights"
        assert all(o[0].versions == (version, version) for o in after), [o[0].versions for o in after]
        updated = AutoModelForCausalLM.from_config(c.reference.config).float().eval()
        updated.load_state_dict(new)
        worst = _assertgreedy(c, updated, c.prompts, after)
        print(f"after update_weights, greedy logprobs / score vs transformers on the new weights: {worst:.1e}")
    finally:
        c.engine.update_weights(checkpoint_weights(c), version + 1)    # the other checks expect these weights
    restored = _sample(c, c.prompts, 1, 0.0)
    assert [o[0].tokens for o in restored] == [o[0].tokens for o in before], "the checkpoint pushed back"


def checkpoint_weights(c: Contract) -> Iterator[tuple[str, torch.Tensor]]:
    from rlcore.megatron.model import read_hf_weights

    return iter(read_hf_weights(c.path).items())


def check_release_and_resume_memory(c: Contract) -> None:
    """The hybrid engine's order (release; resume weights; push; resume KV cache) leaves the engine as it was."""
    if not c.engine.can_release_memory:
        pytest.skip("the backend cannot release memory (can_release_memory is false)")
    before = _sample(c, c.prompts, 1, 0.0)
    c.engine.release_memory()
    c.engine.resume_memory("weights")
    c.engine.update_weights(checkpoint_weights(c), c.engine.version + 1)
    c.engine.resume_memory("kv_cache")
    after = _sample(c, c.prompts, 1, 0.0)
    assert [o[0].tokens for o in after] == [o[0].tokens for o in before]


def check_stop_is_idempotent(c: Contract) -> None:
    """Shutdown runs from several paths (trainer close, atexit, errors): a second stop must be harmless."""
    c.engine.stop()
    c.engine.stop()


CHECKS: dict[str, Callable[[Contract], None]] = {
    "generate_shapes": check_generate_shapes,
    "finish_reasons": check_finish_reasons,
    "stop_token_ids": check_stop_token_ids,
    "min_tokens": check_min_tokens,
    "abort": check_abort,
    "seeds_reproduce_samples": check_seeds_reproduce_samples,
    "different_seeds_differ": check_different_seeds_differ,
    "logprobs_after_temperature": check_logprobs_after_temperature,
    "greedy_equals_score": check_greedy_equals_score,
    "score_from_any_start": check_score_from_any_start,
    "score_refuses_the_first_token": check_score_refuses_the_first_token,
    "update_weights": check_update_weights,
    "release_and_resume_memory": check_release_and_resume_memory,
    "stop_is_idempotent": check_stop_is_idempotent,       # last: it ends the engine
}
