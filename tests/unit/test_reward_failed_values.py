"""A reward function that knows which responses it cannot score returns an exception in place of each one's value:
those responses alone fail, counted with that reason, and the function is called once, not again per response (a
judge's engine is asked once per batch). A non-finite value fails its response alike; a ``RewardBroken`` error is
fatal whatever the strictness."""
import math

import pytest

from rlcore.errors import RlcoreError
from rlcore.rewards import RewardBroken, RewardComposer, SourceDispatch
from rlcore.specs import RewardSpec

EXACT = RewardSpec("exact", lambda rs, ms: [float(r == m["answer"]) for r, m in zip(rs, ms)])
META = [{"answer": "12"}, {"answer": "7"}, {"answer": "3"}, {"answer": "4"}]


class Unreadable(ValueError):
    pass


def counting(fn):
    calls = []

    def counted(responses, metadata, *rest):
        calls.append(len(responses))
        return fn(responses, metadata, *rest)
    return counted, calls


def test_an_exception_in_place_of_a_value_fails_that_response_only_and_calls_once():
    fn, calls = counting(lambda rs, ms: [Unreadable(f"cannot read {r!r}") if r.startswith("?") else float(len(r))
                                         for r in rs])
    scores = RewardComposer([(RewardSpec("judge", fn), 1.0), (EXACT, 0.0)])(["12", "?a", "abc", "?b"], META)
    assert calls == [4]
    assert scores.failed.tolist() == [False, True, False, True]
    assert scores.total[0] == 2.0 and scores.total[2] == 3.0
    assert scores.reasons == {"judge: Unreadable: cannot read '?a'": 1, "judge: Unreadable: cannot read '?b'": 1}
    metrics = scores.metrics()
    assert metrics["reward/failed"] == 2.0 and metrics["reward/judge/mean"] == 2.5
    assert metrics["reward/exact/mean"] == 0.25        # logged at weight 0, on every response


def test_a_non_finite_value_fails_its_response_without_calling_again():
    fn, calls = counting(lambda rs, ms: [math.nan if r == "nan" else math.inf if r == "inf" else 1.0 for r in rs])
    scores = RewardComposer([(RewardSpec("r", fn), 1.0)])(["1", "nan", "inf", "2"], META)
    assert calls == [4]
    assert scores.failed.tolist() == [False, True, True, False]
    assert scores.reasons == {"r: ValueError: non-finite reward nan": 1, "r: ValueError: non-finite reward inf": 1}


def test_named_components_may_fail_a_response_each():
    fn = lambda rs, ms: {"a": [1.0, Unreadable("no a"), 1.0], "b": [2.0, 2.0, Unreadable("no b")]}  # noqa: E731
    scores = RewardComposer([(RewardSpec("two", fn), 1.0)])(["x", "y", "z"], META[:3])
    assert scores.failed.tolist() == [False, True, True]
    assert scores.total[0] == 3.0
    assert scores.reasons == {"two: Unreadable: no a": 1, "two: Unreadable: no b": 1}
    assert math.isnan(scores.components["two/a"][1]) and scores.components["two/b"][1] == 2.0


def test_strict_mode_stops_at_a_returned_exception():
    fn = lambda rs, ms: [1.0, Unreadable("cannot read '?a'")]  # noqa: E731
    with pytest.raises(RlcoreError, match="reward 'judge' failed: Unreadable: cannot read '\\?a'.*strict_rewards"):
        RewardComposer([(RewardSpec("judge", fn), 1.0)], strict=True)(["12", "?a"], META[:2])


def test_a_raising_function_is_still_retried_per_response_and_may_return_exceptions_then():
    def fn(responses, metadata):
        if len(responses) > 1:
            raise RuntimeError("batch failed")
        return [Unreadable("bad") if responses[0] == "b" else 1.0]
    counted, calls = counting(fn)
    scores = RewardComposer([(RewardSpec("r", counted), 1.0)])(["a", "b", "c"], META[:3])
    assert calls == [3, 1, 1, 1]
    assert scores.failed.tolist() == [False, True, False]
    assert scores.reasons == {"r: Unreadable: bad": 1}


def test_a_broken_reward_is_fatal_whatever_the_strictness():
    def fn(responses, metadata):
        raise RewardBroken("the judge's engine died")
    with pytest.raises(RewardBroken, match="engine died"):
        RewardComposer([(RewardSpec("judge", fn), 1.0)])(["a", "b"], META[:2])


def test_per_source_dispatch_keeps_the_returned_failures():
    fn = lambda rs, ms: [Unreadable("bad") if r == "b" else 1.0 for r in rs]  # noqa: E731
    dispatch = SourceDispatch({"s": RewardComposer([(RewardSpec("r", fn), 1.0)]), "t": RewardComposer([(EXACT, 1.0)])})
    meta = [{"data_source": "s"}, {"data_source": "t", "answer": "b"}, {"data_source": "s"}]
    scores = dispatch(["a", "b", "b"], meta)
    assert scores.failed.tolist() == [False, False, True]
    assert scores.reasons == {"r: Unreadable: bad": 1}
