"""The tools agent's turn logic (rlcore_agent_tools.agent), on a scripted engine: each turn's output is given, so every
rule is checked exactly — the trajectory is the engine's tokens with the template's observations between them, every
kind of tool failure is an observation the model reads and is counted, results are cut to size, the episode stays in
its token budget, and a template that cannot be extended starts a new training sample. The real engines, the loop and
the learning are tests/test_tool_runs.py's."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from rlcore.errors import RlcoreError
from rlcore.specs import Completion, RolloutBackend, Sampling
from rlcore.trajectory import episode_samples, episodes_of
from rlcore_agent_tools.agent import ToolAgent
from rlcore_agent_tools.chat import ChatTokens
from rlcore_agent_tools.hermes import hermes_calls
from rlcore_agent_tools.metrics import agent_metrics
from rlcore_agent_tools.tasks.tool_arithmetic import write_tool_tokenizer

LOGPROB = -0.25


class ScriptedEngine(RolloutBackend):
    """Answers turn k of every episode with ``turns[k]`` (text, encoded as the model would sample it; cut at
    max_tokens as an engine cuts), and records the tokens each request was sampled from."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.requests = tokenizer, turns, []

    async def generate(self, tokens, sampling, seed, request_id):
        self.requests.append(list(tokens))
        turn = int(request_id.rsplit("turn", 1)[1])
        out = self.tokenizer.encode(self.turns[turn], add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "length" if len(out) > sampling.max_tokens else "stop"
        out = out[:sampling.max_tokens]
        return Completion(request_id, out, [LOGPROB] * len(out), finish, (3, 3))

    def abort(self, request_id): ...
    def score(self, sequences, start): ...
    def update_weights(self, named_tensors, version): ...
    def stop(self): ...


class Shop:
    """An environment with a tool of each kind of trouble."""

    def reset(self, answer: str, **row) -> None:
        self.answer = answer

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b

    def crash(self, x: int) -> int:
        """Always fails.

        Args:
            x: anything
        """
        raise ZeroDivisionError("the shop is closed")

    def slow(self, x: int) -> int:
        """Sleeps past the timeout.

        Args:
            x: anything
        """
        time.sleep(1.0)
        return x

    def essay(self, x: int) -> str:
        """A long result.

        Args:
            x: anything
        """
        return "".join(str(i % 10) for i in range(200))

    def reward(self) -> float:
        return 0.5


def call(name, **arguments):
    import json
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tool_tokenizer")
    write_tool_tokenizer(str(directory))
    return AutoTokenizer.from_pretrained(directory)


def agent_for(tokenizer, chat=None, max_len=512, **settings):
    cfg = SimpleNamespace(**{"max_turns": 4, "max_tool_response_tokens": 200, "max_parallel_calls": 1,
                             "tool_timeout_s": 0.3, **settings})
    return ToolAgent(tokenizer, chat or ChatTokens(tokenizer), Shop, hermes_calls, cfg, max_len)


def episode(agent, engine, max_tokens=200, row=None):
    row = row or {"answer": "6", "messages": [{"role": "user", "content": "2*3"}]}
    return episode_samples(asyncio.run(agent.run([], row, engine, Sampling(max_tokens), 11, "episode-0-0")))


def test_the_trajectory_is_the_engines_tokens_with_the_templates_observations_between(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("multiply", a=2, b=3), "6"])
    chat = ChatTokens(tokenizer)
    [t] = episode(agent_for(tokenizer, chat), engine)
    first, second = engine.requests
    turn0 = tokenizer.encode(call("multiply", a=2, b=3), add_special_tokens=False) + [tokenizer.eos_token_id]
    observation = tokenizer.encode("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    assert first == chat.prompt([{"role": "user", "content": "2*3"}])
    assert second == first + turn0 + observation          # the next turn is sampled from exactly the trajectory
    assert t.tokens == second + tokenizer.encode("6", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert t.loss_mask == [False] * len(first) + [True] * len(turn0) + [False] * len(observation) + [True] * 2
    assert t.logprobs == [LOGPROB if m else 0.0 for m in t.loss_mask]
    assert t.metadata["final_response"] == "6" and t.metadata["environment_reward"] == 0.5
    assert t.metadata["agent"]["turns"] == 2 and t.metadata["agent"]["tool_calls"] == 1
    assert t.metadata["agent"]["observation_tokens"] == len(observation)
    assert (t.version, t.finish, t.continues) == ((3, 3), "stop", False)


@pytest.mark.parametrize("turn, error, counted", [
    (call("divide", a=1, b=2), "error: unknown tool 'divide'", ("tool_errors", "divide")),
    (call("multiply", a="two", b=3), "error: ", ("tool_errors", "multiply")),
    (call("crash", x=1), "error: crash raised ZeroDivisionError: the shop is closed", ("tool_errors", "crash")),
    (call("slow", x=1), "error: slow took longer than 0.3 s and was stopped", ("tool_timeouts", "slow")),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 2,</tool_call>', "error: ", ("tool_errors", "malformed")),
])
def test_every_tool_failure_is_an_observation_the_model_reads_and_is_counted(tokenizer, turn, error, counted):
    engine = ScriptedEngine(tokenizer, [turn, "6"])
    [t] = episode(agent_for(tokenizer), engine)
    seen = tokenizer.decode(engine.requests[1], skip_special_tokens=True)
    assert f"tool\n{error}" in seen, seen
    kind, tool = counted
    assert t.metadata["agent"][kind] == {tool: 1}
    assert t.metadata["agent"]["turns"] == 2 and t.finish == "stop"      # the episode went on
    metrics = agent_metrics([t])
    assert metrics[f"agent/{kind}/{tool}"] == 1.0 and metrics[f"agent/{kind}"] == 1.0


def test_calls_beyond_max_parallel_calls_are_answered_with_an_error(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("multiply", a=2, b=3) + call("multiply", a=4, b=5), "6"])
    [t] = episode(agent_for(tokenizer, max_parallel_calls=1), engine)
    seen = tokenizer.decode(engine.requests[1], skip_special_tokens=True)
    assert "tool\n6\ntool\nerror: only 1 tool call(s) per turn are run" in seen, seen
    assert t.metadata["agent"]["tool_calls"] == 2 and t.metadata["agent"]["tool_errors"] == {"multiply": 1}


def test_a_long_result_is_cut_in_the_middle_to_max_tool_response_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("essay", x=1), "done"])
    [t] = episode(agent_for(tokenizer, max_tool_response_tokens=40), engine)
    seen = tokenizer.decode(engine.requests[1], skip_special_tokens=True)
    shown = "01234567\n...(200 tokens, cut)...\n3456789"        # head, note, tail: 40 tokens, the note included
    assert f"tool\n{shown}\n" in seen, seen
    assert len(tokenizer.encode(shown, add_special_tokens=False)) == 40
    assert t.metadata["agent"]["truncated_results"] == 1


def test_an_episode_stays_within_its_token_budget(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("multiply", a=2, b=3), "6"])
    turn0 = len(tokenizer.encode(call("multiply", a=2, b=3), add_special_tokens=False)) + 1
    [t] = episode(agent_for(tokenizer), engine, max_tokens=turn0 + 5)     # no room for the observation
    assert t.metadata["agent"]["cut_by_budget"] and t.finish == "length" and len(engine.requests) == 1
    [t] = episode(agent_for(tokenizer), ScriptedEngine(tokenizer, ["1234567890"]), max_tokens=4)
    assert t.finish == "length" and t.response_len == 4                   # the engine cut the turn


def test_a_prompt_that_leaves_no_room_in_the_context_is_one_line(tokenizer):
    with pytest.raises(RlcoreError, match=r"the tools agent's prompt has \d+ tokens \(the task's messages with 4 "
                                          r"tool schema\(s\)\); with rollout.max_response_len 200 it exceeds the "
                                          r"model's context 64"):
        episode(agent_for(tokenizer, max_len=64), ScriptedEngine(tokenizer, ["6"]))


SPLITTING_TEMPLATE = (   # marks an assistant turn once something follows it: earlier tokens change, no suffix can fit
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}~{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_cannot_be_extended_starts_a_new_sample_scored_as_one_episode(tokenizer):
    chat = ChatTokens(tokenizer, chat_template=SPLITTING_TEMPLATE)
    engine = ScriptedEngine(tokenizer, [call("multiply", a=2, b=3), "6"])
    first, second = episode(agent_for(tokenizer, chat), engine)
    assert (first.continues, second.continues) == (False, True)
    assert first.tokens[-1] == tokenizer.eos_token_id and first.loss_mask[-1]     # the first sample ends its turn
    messages = [{"role": "user", "content": "2*3"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "multiply", "content": "6"}]
    assert second.tokens[:second.prompt_len] == chat.prompt(messages, []) == engine.requests[1]   # re-rendered
    assert second.metadata["agent"]["split_samples"] == 1
    assert [len(e) for e in episodes_of([first, second, first])] == [2, 1]
    assert agent_metrics([first, second])["agent/split_samples"] == 1.0           # one episode, counted once
