"""ProcessedPrompts: a group's requests processed once, each sample a copy with its own id, seed and arrival time
(the real engine's samples equal its own batch generate's: bench/rollout_floor.py, and the contract suite)."""
from dataclasses import dataclass, field

from rlcore_rollout_vllm.processed import ProcessedPrompts


@dataclass
class Params:                   # what the copies touch of vLLM's SamplingParams
    seed: int | None = None
    stop: list[int] = field(default_factory=list)


@dataclass
class Request:                  # ... and of its EngineCoreRequest
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Params
    arrival_time: float = 0.0


def test_a_key_is_processed_once_and_every_sample_is_its_own_copy():
    processed, calls = ProcessedPrompts(), []

    def process(request_id, tokens):
        calls.append(request_id)
        return Request(request_id, tokens, Params(seed=-5, stop=[2]))

    samples = [processed.request(f"g-{j}", ("abc", 1), 100 + j, lambda j=j: process(f"g-{j}", [1, 2, 3]))
               for j in range(4)]
    assert calls == ["g-0"]
    assert [s.request_id for s in samples] == ["g-0", "g-1", "g-2", "g-3"]
    assert [s.sampling_params.seed for s in samples] == [100, 101, 102, 103]
    assert len({id(s) for s in samples} | {id(s.sampling_params) for s in samples}) == 8
    assert all(s.arrival_time > 0 and s.prompt_token_ids == [1, 2, 3] for s in samples)
    again = processed.request("h-0", ("abc", 2), None, lambda: process("h-0", [1, 2, 3]))    # another key
    assert calls == ["g-0", "h-0"] and again.sampling_params.seed is None


def test_only_the_keys_processed_last_are_kept():
    processed, calls = ProcessedPrompts(capacity=2), []

    def request(key):
        return processed.request(f"r{len(calls)}", key, 0, lambda: calls.append(key) or Request(key, [], Params()))

    for key in ["a", "b", "a", "c", "a", "b"]:
        request(key)
    assert calls == ["a", "b", "c", "a", "b"]      # "c" pushed out "a", then "a" pushed out "b"
