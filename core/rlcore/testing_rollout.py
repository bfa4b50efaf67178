"""The rollout-backend contract: what rlcore asks of every ``RolloutBackend``, checked against transformers.

A backend's test module gets the whole contract in two statements (``contrib/rollout/*/tests/test_*_contract.py``)::

    from rlcore.testing_rollout import RegisteredBackend, contract_tests
    globals().update(contract_tests(RegisteredBackend("vllm"), in_subprocess=True,
                                    limitations={"seeds_reproduce_samples": "why, and what would lift it"}))

One engine serves the module (an engine start is the expensive part). It is built by the backend's registered
factory, as a run builds it, from a tiny random Qwen3 checkpoint (fp32; head_dim 32, the smallest vLLM's CPU
attention takes) that transformers also loads: transformers is the reference for every number. The checks, each a
test named ``test_<check>``:

- ``generate_shapes``: one list of ``n`` Generations per prompt; one logprob (finite, <= 0) per token; a finish
  reason that fits the tokens ("stop": ends with eos, eos nowhere else; "length": ``max_tokens`` tokens, no eos);
  the ``n`` samples of a prompt are not one sample repeated;
- ``finish_reasons``: greedy decoding stops at eos ("stop", eos included) where transformers' greedy continuation
  reaches it, and runs to ``max_tokens`` ("length") where it does not (prompts picked so that every greedy step
  wins by a clear margin);
- ``seeds_reproduce_samples``: a prompt's samples depend on its seed only, not on the other prompts of the call or
  their order; ``different_seeds_differ``;
- ``logprobs_after_temperature``: sampled tokens' logprobs are log_softmax(logits / T) of transformers (within
  ``tolerance``) and far from T = 1's;
- ``greedy_equals_score``: at T = 0 each token is transformers' argmax (up to ``tolerance``), and its logprob equals
  the teacher-forced ``score`` and transformers' log_softmax(logits);
- ``score_from_any_start``: ``score`` from starts 1, mid and last equals transformers;
  ``score_refuses_the_first_token``: start 0 raises (ValueError or RuntimeError), as no logprob exists there;
- ``update_weights``: pushing other weights (``rlcore.testing.random_hf_state``, as a stream) changes the outputs,
  which then equal transformers on those weights; pushing the checkpoint back restores the first outputs;
- ``release_and_resume_memory``: where ``can_release_memory``, the hybrid engine's order (release, resume weights,
  push, resume the KV cache) gives the same outputs as before (skipped where it cannot);
- ``stop_is_idempotent``: ``stop()`` twice (the last check: it ends the module's engine).

Known limitations of a backend are a table ``{check: reason}``: those checks become strict xfails, so the table
fails as soon as a limitation goes away (and naming a check that does not exist is an error).
"""
from __future__ import annotations

import math
import multiprocessing
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from rlcore.specs import Generation, RolloutBackend

# fp32 on CPU, the largest difference from transformers' logprobs over all the checks, measured: vLLM 3.5e-7, SGLang
# 4.8e-7, transformers' backend 3.6e-7 (batched with left padding); T = 1's logprobs are 0.13-0.17 from T = 0.7's
LOGPROB_TOLERANCE = 2e-6
TEMPERATURE = 0.7
MAX_TOKENS = 8
MAX_MODEL_LEN = 128
GREEDY_MARGIN = 1e-2        # the chosen prompts' greedy steps win by this much (logprob), so no backend can flip one

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
    the way the trainer builds it (one process, rollout.tp=1, a small KV cache)."""
    name: str
    plugin: str = ""
    kv_cache_gib: float = 0.01
    max_model_len: int = MAX_MODEL_LEN

    def __call__(self, model_path: str) -> RolloutBackend:
        from rlcore.config.schema import RolloutConfig
        from rlcore.plugins import load_plugins

        spec = load_plugins([self.plugin or self.name]).registry.get("rollout_backends", self.name)
        cfg = RolloutConfig(backend=self.name, kv_cache_gib=self.kv_cache_gib, tp=1)
        return spec.factory(model_path, cfg, seed=0, max_model_len=self.max_model_len, distributed=False)


# --------------------------------------------------------------------------------------------------------------------
# A backend in a child process: vLLM allows one in-process engine per process, and a test session may host one.

def _serve(factory: Factory, model_path: str, conn) -> None:
    def receive() -> Any:
        return pickle.loads(conn.recv_bytes())

    def stream(ended: list[bool]) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := receive()) is not None:
            yield item
        ended.append(True)

    try:
        backend = factory(model_path)
        conn.send_bytes(pickle.dumps(("ok", backend.can_release_memory)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    while True:
        method, args, kwargs = receive()
        if method == "close":
            return
        try:
            if method == "update_weights":
                ended: list[bool] = []
                try:
                    result = backend.update_weights(stream(ended))
                finally:        # a backend that stopped reading leaves the rest of the stream in the pipe
                    while not ended and receive() is not None:
                        pass
            else:
                result = getattr(backend, method)(*args, **kwargs)
            reply = ("ok", result)
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


class SubprocessBackend(RolloutBackend):
    """``factory(model_path)``'s backend in a spawned child process; every method is forwarded (``update_weights``
    tensor by tensor, as a stream), ``stop`` included, so that its idempotence is the backend's. ``close`` ends the
    child."""

    def __init__(self, factory: Factory, model_path: str, timeout: float = 600.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout
        self._process = ctx.Process(target=_serve, args=(factory, model_path, child), daemon=True)
        self._process.start()
        child.close()
        self.can_release_memory = self._reply()

    def _reply(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"the backend's process did not answer within {self._timeout:g} s")
        try:
            status, value = pickle.loads(self._conn.recv_bytes())
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"the backend's process died (exit code {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"in the backend's process:\n{value}")
        return value

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._conn.send_bytes(pickle.dumps((method, args, kwargs)))
        return self._reply()

    def generate(self, prompts: Sequence[list[int]], n: int, temperature: float, max_tokens: int,
                 seeds: Sequence[int] | None = None) -> list[list[Generation]]:
        return self._call("generate", list(prompts), n, temperature, max_tokens, seeds=seeds)

    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        return self._call("score", list(sequences), list(start))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._conn.send_bytes(pickle.dumps(("update_weights", (), {})))
        try:
            for name, tensor in named_tensors:
                self._conn.send_bytes(pickle.dumps((name, tensor.detach().contiguous())))
        finally:
            self._conn.send_bytes(pickle.dumps(None))       # the end of the stream
        self._reply()

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self, what: str) -> None:
        self._call("resume_memory", what)

    def stop(self) -> None:
        self._call("stop")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send_bytes(pickle.dumps(("close", (), {})))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


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


def _taken(logp: torch.Tensor, tokens: Sequence[int]) -> list[float]:
    return logp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _greedy(model, prompt: list[int], max_tokens: int, eos: int) -> tuple[list[int], float]:
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
    every step decided by at least GREEDY_MARGIN."""
    g = torch.Generator().manual_seed(0)
    stop = length = None
    for _ in range(400):
        prompt = torch.randint(1, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        tokens, margin = _greedy(model, prompt, MAX_TOKENS, eos)
        if margin < GREEDY_MARGIN:
            continue
        if stop is None and tokens[-1] == eos and 2 <= len(tokens) < MAX_TOKENS:
            stop = prompt
        elif length is None and eos not in tokens:
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


# --------------------------------------------------------------------------------------------------------------------
# The checks. Each takes the Contract; contract_tests turns them into tests.

def check_generate_shapes(c: Contract) -> None:
    """What the trainer indexes and masks by: n generations per prompt, a logprob per token, a finish reason."""
    n = 4
    out = c.engine.generate(c.prompts, n=n, temperature=1.0, max_tokens=MAX_TOKENS, seeds=[1, 2, 3])
    assert isinstance(out, list) and len(out) == len(c.prompts), "one list of generations per prompt"
    for samples in out:
        assert len(samples) == n, f"{len(samples)} generations for a prompt, asked for n={n}"
        for gen in samples:
            assert isinstance(gen, Generation)
            assert all(isinstance(t, int) for t in gen.token_ids), gen.token_ids
            assert 1 <= len(gen.token_ids) <= MAX_TOKENS and len(gen.logprobs) == len(gen.token_ids), gen
            assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs), gen.logprobs
            _assert_finish_reason(gen, c.eos)
        assert len({tuple(g.token_ids) for g in samples}) > 1, "the n samples of a prompt are one sample repeated"


def _assert_finish_reason(gen: Generation, eos: int) -> None:
    if gen.finish_reason == "stop":
        assert gen.token_ids[-1] == eos and eos not in gen.token_ids[:-1], gen
    else:
        assert gen.finish_reason == "length", f"finish reason {gen.finish_reason!r} (expected 'stop' or 'length')"
        assert len(gen.token_ids) == MAX_TOKENS and eos not in gen.token_ids, gen


def check_finish_reasons(c: Contract) -> None:
    """The reason must match where generation really ended: the reward and the masks depend on eos being there."""
    stop, length = c.engine.generate([c.stop_prompt, c.length_prompt], n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    expected, _ = _greedy(c.reference, c.stop_prompt, MAX_TOKENS, c.eos)
    assert (stop[0].finish_reason, stop[0].token_ids) == ("stop", expected), (stop[0], expected)
    assert length[0].finish_reason == "length" and len(length[0].token_ids) == MAX_TOKENS, length[0]


def check_seeds_reproduce_samples(c: Contract) -> None:
    """A resumed run, or another split of prompts over engine replicas, samples the same."""
    a, b, other = c.prompts
    first = c.engine.generate([a, b, other], n=3, temperature=1.0, max_tokens=MAX_TOKENS, seeds=[5, 6, 7])
    again = c.engine.generate([other, [9, 8, 7, 6], a], n=3, temperature=1.0, max_tokens=MAX_TOKENS,
                              seeds=[7, 11, 5])
    tokens = [[g.token_ids for g in gens] for gens in first + again]
    assert tokens[0] == tokens[5] and tokens[2] == tokens[3], "a prompt's samples depend on more than its seed"


def check_different_seeds_differ(c: Contract) -> None:
    """Seeds are used, not collapsed into one stream start: otherwise every prompt would draw alike."""
    out = c.engine.generate([c.prompts[2]] * 2, n=3, temperature=1.0, max_tokens=MAX_TOKENS, seeds=[1, 2])
    assert [g.token_ids for g in out[0]] != [g.token_ids for g in out[1]], "two seeds gave the same samples"


def check_logprobs_after_temperature(c: Contract) -> None:
    """The sampling policy's logprobs serve as the old policy (actor.old_logprobs=rollout) and in the mismatch
    metrics: they must be the actor's convention, log_softmax(logits / T)."""
    out = c.engine.generate(c.prompts, n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seeds=[1, 2, 3])
    worst = from_t1 = 0.0
    for prompt, samples in zip(c.prompts, out):
        for gen in samples:
            seq = prompt + gen.token_ids
            worst = max(worst, _max_diff(gen.logprobs, _taken(reference_logprobs(c.reference, seq, len(prompt),
                                                                                 TEMPERATURE), gen.token_ids)))
            from_t1 = max(from_t1, _max_diff(gen.logprobs, _taken(reference_logprobs(c.reference, seq, len(prompt)),
                                                                  gen.token_ids)))
    print(f"sampled logprobs vs transformers at T={TEMPERATURE}: {worst:.1e} (at T=1: {from_t1:.1e})")
    assert worst < c.tolerance, f"sampled logprobs differ from transformers' log_softmax(logits/T) by {worst:.2e}"
    assert from_t1 > 100 * c.tolerance, f"sampled logprobs are within {from_t1:.1e} of T=1's: not after temperature"


def _assert_greedy(c: Contract, model, prompts: list[list[int]], out: list[list[Generation]]) -> float:
    """Every greedy token is ``model``'s argmax (up to the tolerance), its logprob the model's and ``score``'s."""
    scored = c.engine.score([p + o[0].token_ids for p, o in zip(prompts, out)], [len(p) for p in prompts])
    worst = 0.0
    for prompt, o, s in zip(prompts, out, scored):
        gen = o[0]
        logp = reference_logprobs(model, prompt + gen.token_ids, len(prompt))
        ref = _taken(logp, gen.token_ids)
        short = (logp.max(-1).values - torch.tensor(ref, dtype=logp.dtype)).max().item()
        assert short < c.tolerance, f"a greedy token is {short:.2e} below transformers' argmax"
        worst = max(worst, _max_diff(gen.logprobs, ref), _max_diff(s, ref), _max_diff(gen.logprobs, s))
    assert worst < c.tolerance, f"greedy logprobs, score and transformers differ by {worst:.2e}"
    return worst


def check_greedy_equals_score(c: Contract) -> None:
    """Generation and teacher-forced scoring are one model: the engine check after a sync relies on score."""
    out = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    print(f"greedy logprobs / score vs transformers: {_assert_greedy(c, c.reference, c.prompts, out):.1e}")


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
    import pytest

    with pytest.raises((ValueError, RuntimeError)):
        c.engine.score([c.prompts[0]], [0])


def check_update_weights(c: Contract) -> None:
    """Every step's weight sync: a stream of full HF-named tensors replaces every weight, no stale KV is reused."""
    from transformers import AutoModelForCausalLM

    from rlcore.testing import random_hf_state

    new = random_hf_state(c.hf_config, scale=0.2, seed=1)
    before = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        c.engine.update_weights((name, tensor) for name, tensor in new.items())     # a stream, as the sync's
        after = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        assert [o[0].token_ids for o in after] != [o[0].token_ids for o in before], "outputs unchanged by new weights"
        updated = AutoModelForCausalLM.from_config(c.reference.config).float().eval()
        updated.load_state_dict(new)
        worst = _assert_greedy(c, updated, c.prompts, after)
        print(f"after update_weights, greedy logprobs / score vs transformers on the new weights: {worst:.1e}")
    finally:
        c.engine.update_weights(_checkpoint_weights(c))     # the other checks expect the checkpoint's weights
    restored = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    assert [o[0].token_ids for o in restored] == [o[0].token_ids for o in before], "the checkpoint pushed back"


def _checkpoint_weights(c: Contract) -> Iterator[tuple[str, torch.Tensor]]:
    from rlcore.megatron.model import read_hf_weights

    return iter(read_hf_weights(c.path).items())


def check_release_and_resume_memory(c: Contract) -> None:
    """The hybrid engine's order (release; resume weights; push; resume KV cache) leaves the engine as it was."""
    if not c.engine.can_release_memory:
        import pytest

        pytest.skip("the backend cannot release memory (can_release_memory is false)")
    before = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    c.engine.release_memory()
    c.engine.resume_memory("weights")
    c.engine.update_weights(_checkpoint_weights(c))
    c.engine.resume_memory("kv_cache")
    after = c.engine.generate(c.prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    assert [o[0].token_ids for o in after] == [o[0].token_ids for o in before]


def check_stop_is_idempotent(c: Contract) -> None:
    """Shutdown runs from several paths (trainer close, atexit, errors): a second stop must be harmless."""
    c.engine.stop()
    c.engine.stop()


CHECKS: dict[str, Callable[[Contract], None]] = {
    "generate_shapes": check_generate_shapes,
    "finish_reasons": check_finish_reasons,
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


def build_contract(factory: Factory, path: str, in_subprocess: bool = False,
                   tolerance: float = LOGPROB_TOLERANCE, hf_config: dict | None = None) -> Contract:
    """Writes the checkpoint (and a tokenizer) to ``path``, picks the prompts, starts the engine."""
    from rlcore.testing import write_checkpoint

    hf_config = hf_config or contract_hf_config()
    reference = write_checkpoint(hf_config, path)
    eos = hf_config["eos_token_id"]
    write_word_tokenizer(path, hf_config["vocab_size"], eos)
    stop, length = _pick_prompts(reference, hf_config["vocab_size"], eos)
    prompts = [stop, length, [7, 3, 11, 5, 2, 9, 4]]
    engine = SubprocessBackend(factory, path) if in_subprocess else factory(path)
    return Contract(engine, reference, path, hf_config, eos, stop, length, prompts, tolerance)


def contract_tests(factory: Factory, limitations: dict[str, str] | None = None, in_subprocess: bool = False,
                   tolerance: float = LOGPROB_TOLERANCE, hf_config: dict | None = None) -> dict[str, Any]:
    """The module-scoped fixture ``rollout_contract`` and one test per check, to put in a backend's test module
    (``globals().update(...)``). ``factory(model_path)`` builds the backend (picklable when ``in_subprocess``: the
    engine then lives in a child process); ``limitations``: {check: reason} for known, documented limitations, run
    as strict xfails."""
    import pytest

    limitations = dict(limitations or {})
    unknown = set(limitations) - set(CHECKS)
    if unknown:
        raise KeyError(f"limitations name checks that do not exist: {sorted(unknown)} (checks: {sorted(CHECKS)})")

    @pytest.fixture(scope="module")
    def rollout_contract(tmp_path_factory):
        contract = build_contract(factory, str(tmp_path_factory.mktemp("rollout-contract")), in_subprocess,
                                  tolerance, hf_config)
        yield contract
        try:
            contract.engine.stop()
        finally:
            if isinstance(contract.engine, SubprocessBackend):
                contract.engine.close()

    tests: dict[str, Any] = {"rollout_contract": rollout_contract}
    for name, check in CHECKS.items():
        def test(rollout_contract, check=check):
            check(rollout_contract)
        test.__name__ = test.__qualname__ = f"test_{name}"
        test.__doc__ = check.__doc__
        if name in limitations:
            test = pytest.mark.xfail(strict=True, reason=limitations[name])(test)
        tests[test.__name__] = test
    return tests
