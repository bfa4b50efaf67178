"""rlcore.rollout.pausable: a weight push in the middle of generation, invisible to the callers.

The bookkeeping first, on a scripted engine that the test steps by hand (pure logic: which part goes to the engine
when, with what prompt, budget, seed and id, and what the caller gets back). Then the issue's acceptance test on real
engines: a push forced mid-generation gives a completion whose tokens came from two weight versions, recorded in its
versions, each token's logprob the engine's teacher-forced score under the weights that sampled it: on the
transformers backend in this process, on vLLM (the default backend) in a child process, as its contract runs."""
from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import pytest

from rlcore.rollout import pausable
from rlcore.rollout.pausable import PausableEngine, continuation_seed
from rlcore.rollout.requests import run, sample
from rlcore.specs import Completion, RolloutBackend, Sampling
from rlcore_testing.contract import LOGPROB_TOLERANCE, RegisteredBackend, contract_hf_config, write_word_tokenizer

# --------------------------------------------------------------------------------------------------------------------
# A scripted engine.


@dataclass
class Part:
    """One request as the engine saw it, and its state there."""
    request_id: str
    tokens: list[int]
    max_tokens: int
    seed: int | None
    version: int
    done: asyncio.Future
    sampled: list[int] = field(default_factory=list)
    min_tokens: int = 0


class Scripted(RolloutBackend):
    """Every ``step()`` gives each request in flight its next token: 100 * version + its position in the sequence,
    logprob -(position + version / 10), so a test reads off which weights sampled which token where. A request
    reports "length" at the step after its last token (as an engine whose abort can land between the two)."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.live: dict[str, Part] = {}
        self.aborted: list[str] = []
        self.calls: list[str] = []

    async def generate(self, tokens, sampling, seed, request_id):
        part = Part(request_id, list(tokens), sampling.max_tokens, seed, self.version,
                    asyncio.get_running_loop().create_future(), min_tokens=sampling.min_tokens)
        self.parts.append(part)
        self.live[request_id] = part
        return await part.done

    def step(self) -> None:
        for part in list(self.live.values()):
            if len(part.sampled) >= part.max_tokens:
                self._finish(part, "length")
            else:
                part.sampled.append(100 * self.version + len(part.tokens) + len(part.sampled))

    def _finish(self, part: Part, reason: str) -> None:
        del self.live[part.request_id]
        first = len(part.tokens)
        logprobs = [-(first + j + (t // 100) / 10) for j, t in enumerate(part.sampled)]
        part.done.set_result(Completion(part.request_id, part.sampled, logprobs, reason, (part.version, self.version)))

    def abort(self, request_id):
        self.aborted.append(request_id)
        if request_id in self.live:
            self._finish(self.live[request_id], "abort")

    def score(self, sequences, start):
        self.calls.append("score")
        return [[0.0]]

    def update_weights(self, named_tensors, version):
        self.calls.append("update_weights")
        self.version = version

    def release_memory(self):
        self.calls.append("release_memory")

    def resume_memory(self, what):
        self.calls.append(f"resume_memory {what}")

    def stop(self):
        self.calls.append("stop")


async def settle() -> None:
    """Let every task that can run go as far as it can."""
    for _ in range(10):
        await asyncio.sleep(0)


async def steps(engine: Scripted, count: int) -> None:
    for _ in range(count):
        engine.step()
        await settle()


async def push(paused: PausableEngine, version: int) -> None:
    """What the rollout worker does for a weight push."""
    await paused.pause()
    paused.update_weights(iter(()), version)
    paused.resume()
    await settle()


def test_a_partial_pause_resubmits_the_rest_with_the_new_weights_and_joins_the_parts():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        request = asyncio.ensure_future(paused.generate([1, 2, 3], Sampling(6, min_tokens=5), 7, "a"))
        await settle()
        await steps(engine, 2)
        await push(paused, 1)
        await steps(engine, 5)
        return await request

    out = run(scenario())
    first, rest = engine.parts
    assert engine.aborted == ["a"] and (first.request_id, rest.request_id) == ("a", "a/r1")
    assert rest.tokens == [1, 2, 3, 3, 4] and (rest.max_tokens, rest.min_tokens) == (4, 3)   # prompt + tokens so
    # far, what is left
    assert first.seed == 7 and rest.seed == continuation_seed(7, 1) != 7
    assert out.tokens == [3, 4, 105, 106, 107, 108] and out.finish_reason == "length" and out.versions == (0, 1)
    assert out.logprobs == pytest.approx([-3, -4, -5.1, -6.1, -7.1, -8.1]), out.logprobs     # aligned
    stats = paused.stats()
    assert (stats.resumed_requests, stats.resumes, stats.max_resumes, stats.in_flight) == (1, 1, 1, 0), stats
    assert paused.stats().resumes == 0      # counted since the previous read


def test_a_request_interrupted_several_times_gets_new_ids_and_seeds_and_spans_every_version():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        a = asyncio.ensure_future(paused.generate([1], Sampling(8), 5, "a"))
        b = asyncio.ensure_future(paused.generate([2], Sampling(3), None, "b"))
        await settle()
        await steps(engine, 1)
        for version in (1, 2, 3):
            await push(paused, version)
            await steps(engine, 1)
        await steps(engine, 8)
        return await a, await b

    a, b = run(scenario())
    a_parts = [p for p in engine.parts if p.request_id.startswith("a")]
    b_parts = [p for p in engine.parts if p.request_id.startswith("b")]
    assert [p.request_id for p in a_parts] == ["a", "a/r1", "a/r2", "a/r3"]
    assert len({p.seed for p in a_parts}) == 4 and [p.seed for p in b_parts] == [None] * 3     # None stays None
    assert a.versions == (0, 3) and [t // 100 for t in a.tokens] == [0, 1, 2, 3, 3, 3, 3, 3], a.tokens
    assert a.tokens == [1 + j + 100 * (t // 100) for j, t in enumerate(a.tokens)]    # each at its position
    assert len(a.logprobs) == len(a.tokens) == 8 and a.finish_reason == "length"
    assert b.versions == (0, 2) and len(b.tokens) == 3      # b: a token per version, its budget spent at the third
    stats = paused.stats()
    assert (stats.resumed_requests, stats.resumes, stats.max_resumes) == (2, 5, 3), stats


def test_a_request_whose_budget_is_used_up_when_interrupted_ends_at_its_length():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        request = asyncio.ensure_future(paused.generate([1], Sampling(2), 1, "a"))
        await settle()
        await steps(engine, 2)          # both tokens sampled, "length" not reported yet
        await push(paused, 1)
        return await request

    out = run(scenario())
    assert (out.finish_reason, len(out.tokens), out.versions) == ("length", 2, (0, 0)), out
    assert len(engine.parts) == 1 and paused.stats().resumes == 0


def test_a_part_aborted_before_its_first_token_does_not_count_as_a_version_seen():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        request = asyncio.ensure_future(paused.generate([1], Sampling(3), 1, "a"))
        await settle()
        await push(paused, 1)           # before any step
        await steps(engine, 4)
        return await request

    out = run(scenario())
    assert out.versions == (1, 1) and len(engine.parts) == 2 and len(out.tokens) == 3, out


def test_a_user_abort_is_final_while_paused_or_not():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        waiting = asyncio.ensure_future(paused.generate([1], Sampling(8), 1, "interrupted"))
        running = asyncio.ensure_future(paused.generate([2], Sampling(8), 2, "running"))
        await settle()
        await steps(engine, 2)
        paused.abort("running")         # not paused: its part on the engine is aborted, for good
        await settle()
        await paused.pause()
        late = asyncio.ensure_future(paused.generate([3], Sampling(8), 3, "late"))     # waits for the resume
        await settle()
        paused.abort("interrupted")
        paused.abort("late")
        paused.abort("unknown")         # no error
        await settle()
        assert waiting.done() and late.done()       # answered while still paused
        paused.resume()
        await steps(engine, 3)
        return waiting.result(), await running, late.result()

    waiting, running, late = run(scenario())
    assert (waiting.finish_reason, waiting.tokens, waiting.versions) == ("abort", [1, 2], (0, 0)), waiting
    assert (running.finish_reason, running.tokens) == ("abort", [1, 2]), running
    assert (late.finish_reason, late.tokens, late.logprobs) == ("abort", [], []), late
    assert [p.request_id for p in engine.parts] == ["interrupted", "running"] and not engine.live
    assert paused.stats().resumes == 0


def test_without_partial_a_pause_waits_for_the_requests_in_flight_and_new_ones_wait_for_the_resume():
    engine = Scripted()
    paused = PausableEngine(engine, partial=False)

    async def scenario():
        first = asyncio.ensure_future(paused.generate([1], Sampling(3), 1, "first"))
        await settle()
        await steps(engine, 1)
        pause = asyncio.ensure_future(paused.pause())
        later = asyncio.ensure_future(paused.generate([2], Sampling(2), 2, "later"))
        await steps(engine, 2)
        assert not pause.done() and not engine.aborted      # drains: 2 tokens sampled, "length" not reported yet
        await steps(engine, 1)
        assert pause.done() and first.done() and [p.request_id for p in engine.parts] == ["first"]
        paused.update_weights(iter(()), 1)
        paused.resume()
        await settle()
        await steps(engine, 3)
        return first.result(), await later

    first, later = run(scenario())
    assert (first.finish_reason, first.versions, len(first.tokens)) == ("length", (0, 0), 3), first
    assert (later.finish_reason, later.versions, len(later.tokens)) == ("length", (1, 1), 2), later


def test_idle_time_counts_nothing_in_flight_or_paused_since_the_last_read(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(pausable, "monotonic", lambda: now[0])
    engine = Scripted()
    paused = PausableEngine(engine, partial=False)

    async def scenario():
        now[0] = 10.0
        request = asyncio.ensure_future(paused.generate([1], Sampling(1), 1, "a"))
        await settle()
        now[0] = 14.0
        busy = paused.stats()
        now[0] = 16.0
        pause = asyncio.ensure_future(paused.pause())
        await settle()
        now[0] = 18.0
        await steps(engine, 2)          # finishes
        await pause
        now[0] = 20.0
        paused.resume()
        await request
        now[0] = 25.0
        return busy, paused.stats()

    busy, after = run(scenario())
    assert (busy.in_flight, busy.idle_s) == (1, 10.0), busy
    assert (after.in_flight, after.idle_s) == (0, 9.0), after       # paused 16 -> 20, nothing in flight 20 -> 25


def test_the_rest_is_the_engines():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)
    engine.can_release_memory = True
    paused.update_weights(iter(()), 4)
    assert paused.version == 4 and paused.can_release_memory
    assert paused.score([[1, 2]], [1]) == [[0.0]]
    paused.release_memory()
    paused.resume_memory("weights")
    paused.stop()
    assert engine.calls == ["update_weights", "score", "release_memory", "resume_memory weights", "stop"]


def test_a_request_id_in_flight_is_refused_and_an_engine_error_reaches_the_caller():
    engine = Scripted()
    paused = PausableEngine(engine, partial=True)

    async def scenario():
        first = asyncio.ensure_future(paused.generate([1], Sampling(2), 1, "same"))
        await settle()
        with pytest.raises(ValueError, match="'same' is already in flight"):
            await paused.generate([1], Sampling(2), 1, "same")
        engine.live["same"].done.set_exception(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await first

    run(scenario())
    assert paused.stats().in_flight == 0
    run(asyncio.wait_for(paused.pause(), 5))       # nothing left in flight to wait for


# --------------------------------------------------------------------------------------------------------------------
# Real engines: a push forced in the middle of a request.

PROMPT = [7, 3, 11, 5, 2, 9, 4]
MAX_TOKENS = 24


def push_mid_generation(factory, path: str, pushes: int = 1) -> dict:
    """A seeded request at T = 1 through ``PausableEngine(partial=True)`` over ``factory(path)``, interrupted
    ``pushes`` times by a push of other weights (versions 1, 2, ...) after a few decode steps each; then the
    completion's tokens scored under every version's weights. Returns plain data (it also runs in a child process)."""
    from rlcore.megatron.model import read_hf_weights
    from rlcore_testing.models import random_hf_state

    hf_config = contract_hf_config()
    weights = [read_hf_weights(path)] + [random_hf_state(hf_config, scale=0.2, seed=v) for v in range(1, pushes + 1)]
    engine = factory(path)
    try:
        paused = PausableEngine(engine, partial=True)
        sampling = Sampling(MAX_TOKENS, 1.0)
        # a seed whose uninterrupted run has no eos within MAX_TOKENS, so the push lands mid-request
        seed, alone = next((j, c) for j, c in enumerate(sample(paused, [PROMPT], 8, sampling, seeds=[0])[0])
                           if c.finish_reason == "length")     # sample j is seeded 0 + j

        async def interrupted() -> Completion:
            request = asyncio.ensure_future(paused.generate(PROMPT, sampling, seed, "long"))
            for version in range(1, pushes + 1):
                for _ in range(5):      # the engine's stepping task decodes a token per turn of the event loop
                    await asyncio.sleep(0)
                await paused.pause()
                paused.update_weights(iter(weights[version].items()), version)
                paused.resume()
            return await request

        out = run(interrupted())
        stats = paused.stats()
        scores = []
        for version, state in enumerate(weights):
            paused.update_weights(iter(state.items()), pushes + 1 + version)
            scores.append(paused.score([PROMPT + out.tokens], [len(PROMPT)])[0])
        return dict(out=out, alone=alone, stats=stats, scores=scores)
    finally:
        engine.stop()


def sampled_by(logprobs: list[float], scores: list[list[float]], tolerance: float) -> list[int]:
    """For each token, the one version whose teacher-forced score equals its logprob (asserted: exactly one)."""
    versions = []
    for j, logprob in enumerate(logprobs):
        matching = [v for v, score in enumerate(scores) if abs(score[j] - logprob) < tolerance]
        assert len(matching) == 1, f"token {j}: logprob {logprob} matches the scores of versions {matching}: " \
                                   f"{[score[j] for score in scores]}"
        versions.append(matching[0])
    return versions


def assert_spans_the_pushes(result: dict, pushes: int) -> None:
    out, alone = result["out"], result["alone"]
    assert out.versions == (0, pushes), out
    assert len(out.logprobs) == len(out.tokens)
    assert len(out.tokens) == MAX_TOKENS or out.finish_reason == "stop", out
    versions = sampled_by(out.logprobs, result["scores"], LOGPROB_TOLERANCE)
    print(f"versions that sampled each token: {versions}")
    assert versions == sorted(versions) and set(versions) == set(range(pushes + 1)), versions
    before = versions.count(0)
    assert out.tokens[:before] == alone.tokens[:before]     # the first part is the uninterrupted run's, by its seed
    stats = result["stats"]
    assert (stats.resumed_requests, stats.resumes, stats.max_resumes) == (1, pushes, pushes), stats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from rlcore_testing.models import write_checkpoint

    path = str(tmp_path_factory.mktemp("pausable"))
    hf_config = contract_hf_config()
    write_checkpoint(hf_config, path)
    write_word_tokenizer(path, hf_config["vocab_size"], hf_config["eos_token_id"])    # vLLM loads one
    return path


def assert_its_loss_uses_the_behaviour_logprobs(out: Completion) -> None:
    """The completion as the learner gets it: a trajectory whose batch row holds the behaviour logprobs at its tokens'
    label positions and the oldest version that sampled it (so a learner at version 1 treats it as off-policy and
    computes the old logprobs), and the correction's token weights min(exp(old - behaviour), C) taken from them."""
    import torch

    from rlcore.rollout_correction import RolloutCorrection, correction
    from rlcore.trajectory import Trajectory, to_batch

    batch = to_batch([Trajectory.single_turn(PROMPT, out.tokens, out.logprobs, version=out.versions)], pad_id=0)
    labels = slice(len(PROMPT) - 1, len(PROMPT) - 1 + len(out.tokens))
    assert batch["rollout_logprobs"][0, labels].tolist() == pytest.approx(out.logprobs, abs=1e-6)
    assert batch["response_mask"][0, labels].all() and batch["version"].tolist() == [0]
    mask = batch["response_mask"]
    old = batch["rollout_logprobs"] + 0.1 * mask           # the learner's old logprobs, 0.1 above the behaviour's
    weights, _, _ = correction(old, batch["rollout_logprobs"], mask, RolloutCorrection(rollout_is="token"))
    assert weights is not None
    assert weights[0, labels] == pytest.approx(torch.full((len(out.tokens),), float(torch.tensor(0.1).exp())))


def test_a_push_mid_generation_on_transformers_gives_a_trajectory_of_two_versions(checkpoint):
    result = push_mid_generation(RegisteredBackend("hf"), checkpoint)
    assert_spans_the_pushes(result, pushes=1)
    assert_its_loss_uses_the_behaviour_logprobs(result["out"])


def test_two_pushes_during_one_request_on_transformers(checkpoint):
    assert_spans_the_pushes(push_mid_generation(RegisteredBackend("hf"), checkpoint, pushes=2), pushes=2)


def test_without_partial_transformers_finishes_the_request_on_the_old_weights(checkpoint):
    from rlcore_testing.models import random_hf_state

    engine = RegisteredBackend("hf")(checkpoint)
    paused = PausableEngine(engine, partial=False)
    greedy = Sampling(16, 0.0)
    alone = run(engine.generate(PROMPT, greedy, None, "alone"))

    async def scenario():
        first = asyncio.ensure_future(paused.generate(PROMPT, greedy, None, "first"))
        for _ in range(3):
            await asyncio.sleep(0)
        pause = asyncio.ensure_future(paused.pause())
        await asyncio.sleep(0)
        later = asyncio.ensure_future(paused.generate(PROMPT, greedy, None, "later"))
        await pause
        assert first.done() and not later.done()
        paused.update_weights(iter(random_hf_state(contract_hf_config(), 0.2, seed=1).items()), 1)
        paused.resume()
        return first.result(), await later

    try:
        first, later = run(scenario())
    finally:
        engine.stop()
    assert (first.tokens, first.versions) == (alone.tokens, (0, 0)), first
    assert later.versions == (1, 1) and later.tokens != alone.tokens, later


def test_a_user_abort_during_a_pause_on_transformers_returns_the_first_part(checkpoint):
    engine = RegisteredBackend("hf")(checkpoint)
    paused = PausableEngine(engine, partial=True)
    greedy = Sampling(16, 0.0)
    alone = run(engine.generate(PROMPT, greedy, None, "alone"))

    async def scenario():
        request = asyncio.ensure_future(paused.generate(PROMPT, greedy, None, "aborted"))
        for _ in range(4):
            await asyncio.sleep(0)
        await paused.pause()
        paused.abort("aborted")
        out = await request
        paused.resume()
        return out

    try:
        out = run(scenario())
    finally:
        engine.stop()
    assert out.finish_reason == "abort" and 0 < len(out.tokens) < 16 and out.versions == (0, 0), out
    assert out.tokens == alone.tokens[:len(out.tokens)] and paused.stats().resumes == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_push_mid_generation_on_vllm_gives_a_trajectory_of_two_versions(checkpoint):
    """In a child process: vLLM allows one in-process engine per process, and the session may hold one."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        result = child.submit(push_mid_generation, RegisteredBackend("vllm"), checkpoint).result(timeout=600)
    assert_spans_the_pushes(result, pushes=1)
