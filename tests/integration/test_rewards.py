"""Reward composition: weighted components each logged, a reward that raises or returns NaN fails only the samples
it cannot score (counted, reason kept; strict mode stops instead), a broken contract is always fatal, and failed
samples are neutral for their group and masked out of the loss in a real training step."""
import math

import pytest
import torch

from rlcore.errors import RlcoreError
from rlcore.loop import step
from rlcore.rewards import RewardComposer, WrongRewardShape, neutral_fill
from rlcore.specs import RewardSpec

EXACT = RewardSpec("exact", lambda rs, ms: [float(r == m["answer"]) for r, m in zip(rs, ms)])
SHAPE = RewardSpec("shape", lambda rs, ms: {"short": [float(len(r) <= 2) for r in rs],
                                            "digits": [float(r.isdigit()) for r in rs]})


def picky(responses, metadata):
    out = []
    for r in responses:
        if r == "boom":
            raise ValueError("cannot parse 'boom'")
        out.append(math.nan if r == "nan" else 1.0)
    return out


PICKY = RewardSpec("picky", picky)
META = [{"answer": "12"}, {"answer": "7"}, {"answer": "3"}, {"answer": "4"}]


def test_weighted_sum_and_every_component():
    scores = RewardComposer([(EXACT, 1.0), (SHAPE, 0.5)])(["12", "8", "abc", "4"], META)
    # exact: 1 0 0 1; shape/short: 1 1 0 1; shape/digits: 1 1 0 1
    assert scores.total.tolist() == [2.0, 1.0, 0.0, 2.0]
    assert set(scores.components) == {"exact", "shape/short", "shape/digits"}
    assert scores.metrics() == {"reward/failed": 0.0, "reward/exact/mean": 0.5, "reward/shape/short/mean": 0.75,
                                "reward/shape/digits/mean": 0.75}


def test_failures_are_isolated_counted_and_explained():
    scores = RewardComposer([(EXACT, 1.0), (PICKY, 1.0)])(["12", "boom", "nan", "4"], META)
    assert scores.failed.tolist() == [False, True, True, False]
    assert scores.total[0] == 2.0 and scores.total[3] == 2.0
    assert scores.reasons == {"picky: ValueError: cannot parse 'boom'": 1,
                              "picky: ValueError: non-finite reward nan": 1}
    assert scores.metrics()["reward/failed"] == 2.0 and scores.metrics()["reward/exact/mean"] == 0.5


def test_strict_mode_stops_at_the_first_failure():
    with pytest.raises(RlcoreError, match="reward 'picky' failed: ValueError: cannot parse 'boom'.*strict_rewards"):
        RewardComposer([(PICKY, 1.0)], strict=True)(["12", "boom"], META[:2])


def test_a_broken_contract_is_fatal_even_when_lenient():
    short = RewardSpec("short", lambda rs, ms: [1.0])
    with pytest.raises(WrongRewardShape, match="reward 'short' returned 1 values for 3 responses"):
        RewardComposer([(short, 1.0)])(["a", "b", "c"], META[:3])


def test_failed_samples_take_their_group_mean():
    rewards = torch.tensor([1.0, math.nan, 0.0, math.nan, math.nan])
    groups = torch.tensor([0, 0, 0, 1, 1])
    filled = neutral_fill(rewards, torch.isnan(rewards), groups)
    assert filled.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]      # group 1 has nothing scored: 0


@pytest.mark.slow
def test_a_training_step_survives_a_raising_reward(quickstart, caplog):
    """The real loop: a reward that raises on some responses fails those samples only; the step trains on the rest."""
    calls = {"n": 0}

    def flaky(responses, metadata):
        calls["n"] += 1
        if len(responses) > 1:
            raise RuntimeError("flaky grader")
        if calls["n"] % 3 == 0:
            raise RuntimeError("grader timeout")
        return [float(r.strip() == str(m["answer"])) for r, m in zip(responses, metadata)]

    original = quickstart.source.rewards
    quickstart.source.rewards = RewardComposer([(RewardSpec("flaky", flaky), 1.0)])
    try:
        with caplog.at_level("WARNING"):
            metrics = step(quickstart.source, quickstart.learner, quickstart.cadence, quickstart.cfg.trainer.steps)
    finally:
        quickstart.source.rewards = original
    n = quickstart.cfg.trainer.prompts_per_step * quickstart.cfg.rollout.n
    assert 0 < metrics["reward/failed"] < n, metrics
    assert "grader timeout" in caplog.text
    assert math.isfinite(metrics["reward/mean"]) and math.isfinite(metrics["actor/pg_loss"]), metrics
