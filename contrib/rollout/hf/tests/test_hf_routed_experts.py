"""The transformers backend's routed experts beyond the contract's check (test_hf_contract.py runs that on Qwen3-MoE,
Mixtral and DeepSeek-V3): the check fails for the bugs it is there to catch, a request paused and resumed by a
partial pause keeps its first part's routes, a model without MoE routers is refused by name, and an engine started
without routes returns none."""
import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rlcore.errors import RlcoreError
from rlcore.rollout.pausable import PausableEngine
from rlcore.rollout.requests import run
from rlcore.specs import Completion, RolloutBackend, Sampling
from rlcore_testing.contract import RegisteredBackend, contract_hf_config
from rlcore_testing.models import write_checkpoint
from rlcore_testing.routed_experts import ROUTED_EXPERTS_CHECKS, build_moe_contract, moe_hf_config
from rlcore_rollout_hf import HFRollout

PROMPT = [7, 3, 11, 5, 2, 9, 4]
LONG = Sampling(12, 0.0, min_tokens=12)      # eos banned: runs to its length


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    c = build_moe_contract(RegisteredBackend("hf", routed_experts=True), str(tmp_path_factory.mktemp("moe")),
                           hf_config=moe_hf_config("qwen3_moe"))
    yield c
    c.engine.stop()


class Wrapped(RolloutBackend):
    """The engine, each completion passed through ``change`` (a bug), or recorded."""

    def __init__(self, inner: RolloutBackend, change=lambda out: out):
        self.inner, self.change, self.completions = inner, change, []

    @property
    def version(self):
        return self.inner.version

    async def generate(self, tokens, sampling, seed, request_id):
        out = self.change(await self.inner.generate(tokens, sampling, seed, request_id))
        self.completions.append(out)
        return out

    def abort(self, request_id):
        self.inner.abort(request_id)

    def score(self, sequences, start):
        return self.inner.score(sequences, start)

    def update_weights(self, named_tensors, version):
        self.inner.update_weights(named_tensors, version)

    def stop(self):
        self.inner.stop()


def _routes(change):
    return lambda out: dataclasses.replace(out, routed_experts=change(out.routed_experts))


BUGS = {
    "none returned": lambda out: dataclasses.replace(out, routed_experts=None),
    "layers reversed": _routes(lambda r: r.flip(1)),
    "one token late": _routes(lambda r: torch.cat([r[1:], r[-1:]])),    # the row of the token after
    "last token's row kept": _routes(lambda r: torch.cat([r, r[-1:]])),
    "rows descending": _routes(lambda r: r.flip(2)),
    "as int64": _routes(lambda r: r.long()),
}


@pytest.mark.parametrize("bug", BUGS)
def test_the_routed_experts_check_fails_for_the_bug(moe, bug):
    check = ROUTED_EXPERTS_CHECKS["routed_experts"]
    with pytest.raises(AssertionError):
        check(dataclasses.replace(moe, engine=Wrapped(moe.engine, BUGS[bug])))
    check(moe)      # and the backend without the bug passes it


def test_a_request_paused_and_resumed_keeps_its_first_parts_routes(moe):
    parts = Wrapped(moe.engine)
    engine = PausableEngine(parts, partial=True)

    async def pause_mid_generation():
        request = asyncio.ensure_future(engine.generate(PROMPT, LONG, None, "paused"))
        for _ in range(100):        # the decode task takes a step per turn of the loop
            await asyncio.sleep(0)
            if len(getattr(moe.engine._in_flight.get("paused"), "tokens", ())) >= 4:
                break
        await engine.pause()
        engine.resume()
        return await request

    out = run(pause_mid_generation())
    alone = run(moe.engine.generate(PROMPT, LONG, None, "alone"))
    first, second = parts.completions
    assert first.finish_reason == "abort" and 4 <= len(first.tokens) < LONG.max_tokens, first
    assert out.finish_reason == "length" and out.tokens == first.tokens + second.tokens == alone.tokens, out
    routes, before = out.routed_experts, first.routed_experts
    assert routes is not None and before is not None and second.routed_experts is not None
    assert routes.shape[0] == len(PROMPT) + len(out.tokens) - 1 == len(second.routed_experts)
    assert len(before) == len(PROMPT) + len(first.tokens) - 1
    assert torch.equal(routes[:len(before)], before)        # only the second part's new rows appended
    assert torch.equal(routes[len(before):], second.routed_experts[len(before):])
    assert torch.equal(routes, alone.routed_experts)         # as if never paused (the same weights)


def test_a_model_without_moe_routers_is_refused_by_name(tmp_path):
    write_checkpoint(contract_hf_config(), str(tmp_path))
    with pytest.raises(RlcoreError, match="rollout.backend=hf: Qwen3ForCausalLM has no MoE router to return routed "
                                          "experts from"):
        HFRollout(str(tmp_path), SimpleNamespace(tp=1), routed_experts=True)


def test_an_engine_started_without_routes_returns_none(moe):
    engine = HFRollout(moe.path, SimpleNamespace(tp=1))
    try:
        out = run(engine.generate(PROMPT, Sampling(3, 0.0), None, "plain"))
    finally:
        engine.stop()
    assert isinstance(out, Completion) and len(out.tokens) == 3 and out.routed_experts is None


def test_a_multi_turn_episodes_routes_cover_its_observations_from_the_next_turns_prefill(moe):
    """Two turns with an observation between them, built as the tools agent builds them (its ``Transcript``): the
    episode's routes cover every token fed, the observation's from the second turn's prefill, and equal
    transformers' routing of the whole episode (the weights do not change between the turns)."""
    from rlcore_agent_tools.chat import Transcript
    from rlcore_testing.routed_experts import reference_routes

    transcript = Transcript(PROMPT)
    for turn in range(2):
        if turn:
            transcript.inserted([12, 6, 1])                      # an observation the policy did not sample
        out = run(moe.engine.generate(list(transcript.tokens), Sampling(4, 0.0, min_tokens=4), None, f"turn{turn}"))
        transcript.sampled(out.tokens, out.logprobs, out.routed_experts)
    episode = transcript.trajectory()
    assert len(episode.routed_experts) == len(episode.tokens) - 1 == len(PROMPT) + 4 + 3 + 4 - 1
    assert torch.equal(episode.routed_experts, reference_routes(moe.reference, episode.tokens[:-1]))
