"""The transformers backend's own batching of concurrent requests (the contract checks the rest): a request that joins
a batch mid-decode samples as it would alone, a weight push mid-request shows in its versions, a cancelled caller's
request leaves the batch, an error in a decode step reaches every waiter, bad sampling settings are named."""
import asyncio
from types import SimpleNamespace

import pytest

from rlcore.megatron.model import read_hf_weights
from rlcore.rollout.requests import run
from rlcore.specs import Sampling
from rlcore_testing.models import write_checkpoint
from rlcore_testing.contract import contract_hf_config
from rlcore_rollout_hf import HFRollout

PROMPT, OTHER = [7, 3, 11, 5, 2, 9, 4], [3, 1, 4]
LONG = Sampling(16, 1.0)        # random weights: eos is rarely sampled within 16 tokens at T = 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf-requests"))
    write_checkpoint(contract_hf_config(), path)
    engine = HFRollout(path, SimpleNamespace(tp=1))
    engine.path = path
    yield engine
    engine.stop()


async def steps(count: int) -> None:
    """Let the decode task take about ``count`` steps."""
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_request_joining_mid_decode_samples_as_it_would_alone(engine):
    alone = run(engine.generate(OTHER, LONG, 3, "alone"))

    async def join_late():
        first = asyncio.ensure_future(engine.generate(PROMPT, LONG, 1, "first"))
        await steps(4)
        decoded = len(engine._in_flight.get("first").tokens)
        return decoded, await asyncio.gather(first, engine.generate(OTHER, LONG, 3, "late"))

    decoded, (first, late) = run(join_late())
    assert decoded >= 2 and late.tokens == alone.tokens, (decoded, late, alone)
    assert max(abs(a - b) for a, b in zip(late.logprobs, alone.logprobs)) < 1e-5


def test_a_weight_push_mid_request_shows_in_its_versions(engine):
    version = engine.version

    async def push_during():
        request = asyncio.ensure_future(engine.generate(PROMPT, Sampling(16, 0.0), None, "during"))
        await steps(3)
        engine.update_weights(iter(read_hf_weights(engine.path).items()), version + 1)
        return await request

    during = run(push_during())
    after = run(engine.generate(PROMPT, Sampling(16, 0.0), None, "after"))
    assert during.versions == (version, version + 1) and after.versions == (version + 1, version + 1)
    assert during.tokens == after.tokens        # the same weights pushed back


def test_a_cancelled_caller_leaves_the_batch(engine):
    async def cancel_one():
        cancelled = asyncio.ensure_future(engine.generate(PROMPT, LONG, 1, "cancelled"))
        kept = asyncio.ensure_future(engine.generate(OTHER, LONG, 2, "kept"))
        await steps(3)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)     # the cancellation has landed
        return [request_id for request_id, _ in engine._in_flight.items()], cancelled, await kept

    left, cancelled, kept = run(cancel_one())
    assert left == ["kept"] and cancelled.cancelled() and kept.finish_reason in ("stop", "length"), (left, kept)


def test_an_error_in_a_decode_step_reaches_every_waiter(engine):
    vocab = engine.model.config.vocab_size
    both = asyncio.gather(engine.generate(PROMPT, LONG, 1, "fine"), engine.generate([vocab], LONG, 1, "bad"),
                          return_exceptions=True)
    out = run(asyncio.wait_for(both, 60))
    assert all(isinstance(o, IndexError) for o in out), out
    assert run(engine.generate(PROMPT, Sampling(2, 0.0), None, "next")).finish_reason in ("stop", "length")


@pytest.mark.parametrize("sampling, named", [
    (Sampling(0), "max_tokens"), (Sampling(4, -1.0), "temperature"), (Sampling(4, top_k=0), "top_k"),
    (Sampling(4, top_p=0.0), "top_p"), (Sampling(4, top_p=1.5), "top_p")])
def test_bad_sampling_is_named(engine, sampling, named):
    with pytest.raises(ValueError, match=f"Sampling.{named} must be"):
        run(engine.generate(PROMPT, sampling, None, "bad"))


def test_a_request_id_in_flight_is_refused(engine):
    async def twice():
        first = asyncio.ensure_future(engine.generate(PROMPT, LONG, 1, "same"))
        await steps(1)
        with pytest.raises(ValueError, match="'same' is already in flight"):
            await engine.generate(OTHER, LONG, 2, "same")
        return await first

    assert run(twice()).request_id == "same"


def test_top_k_one_samples_greedily(engine):
    greedy = run(engine.generate(PROMPT, Sampling(8, 0.0), None, "greedy"))
    top1 = run(engine.generate(PROMPT, Sampling(8, 1.0, top_k=1), 5, "top1"))
    assert top1.tokens == greedy.tokens and all(lp == 0 for lp in top1.logprobs), top1
