"""Agents (rlcore.specs.Agent): how an episode uses the engine. The built-in single_turn is the engine's completion
after the prompt; an agent with turns keeps observations out of the loss; a run names its agent and an unknown one is
refused before anything starts. On the transformers backend (real engine, in-process, per-request seeds)."""
import pytest

from rlcore.rollout.agents import SingleTurn
from rlcore.rollout.requests import episodes, sample
from rlcore.specs import Agent, Sampling
from rlcore_testing.contract import RegisteredBackend, build_contract
from rlcore.trajectory import Trajectory, to_batch


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    c = build_contract(RegisteredBackend("hf"), str(tmp_path_factory.mktemp("agents")))
    yield c
    c.engine.stop()


def test_single_turn_is_the_prompt_and_the_engines_completion(contract):
    sampling, seeds = Sampling(8, 1.0), [1, 2, 3]
    completions = sample(contract.engine, contract.prompts, 2, sampling, seeds)
    trajectories = episodes(SingleTurn(), contract.engine, contract.prompts, [{"row": i} for i in range(3)], 2,
                            sampling, seeds)
    for i, (prompt, done, made) in enumerate(zip(contract.prompts, completions, trajectories)):
        for c, t in zip(done, made):
            assert t.tokens == prompt + c.tokens and t.logprobs == [0.0] * len(prompt) + c.logprobs
            assert t.loss_mask == [False] * len(prompt) + [True] * len(c.tokens)
            assert (t.version, t.finish, t.metadata) == (c.versions, c.finish_reason, {"row": i})


class TwoTurns(Agent):
    """Answer, read an observation (tokens the policy did not sample), answer again."""
    OBSERVATION = [5, 6, 7]

    async def run(self, prompt, metadata, engine, sampling, seed, request_id):
        first = await engine.generate(prompt, sampling, seed, f"{request_id}-turn0")
        context = prompt + first.tokens + self.OBSERVATION
        second = await engine.generate(context, sampling, seed, f"{request_id}-turn1")
        return Trajectory(tokens=context + second.tokens,
                          loss_mask=[False] * len(prompt) + [True] * len(first.tokens)
                          + [False] * len(self.OBSERVATION) + [True] * len(second.tokens),
                          logprobs=[0.0] * len(prompt) + first.logprobs + [0.0] * len(self.OBSERVATION)
                          + second.logprobs,
                          version=(first.versions[0], second.versions[1]), finish=second.finish_reason,
                          metadata=metadata)


def test_an_agent_with_turns_trains_only_on_what_the_policy_sampled(contract):
    greedy = Sampling(4, 0.0, stop_token_ids=tuple(range(64)))      # every token stops: one token a turn
    [[t]] = episodes(TwoTurns(), contract.engine, [contract.prompts[1]], [{}], 1, greedy)
    prompt_len = len(contract.prompts[1])
    assert len(t.tokens) == prompt_len + 1 + 3 + 1
    batch = to_batch([t], pad_id=0)
    # label-aligned: position p scores token p + 1; the loss sees the two sampled tokens only
    sampled = [p for p in range(len(t.tokens) - 1) if batch["response_mask"][0, p]]
    assert sampled == [prompt_len - 1, prompt_len + 3]
    assert batch["rollout_logprobs"][0, sampled].tolist() == pytest.approx([t.logprobs[prompt_len],
                                                                           t.logprobs[-1]])


def test_a_run_names_its_agent_and_an_unknown_one_is_refused(tmp_path):
    from rlcore.config import load_config
    from rlcore.errors import PluginError
    from rlcore.plugins import load_plugins
    from rlcore.run import Run

    cfg = load_config("quickstart", ["rollout.agent=multi_turn_tools", f"run.dir={tmp_path}"])
    with pytest.raises(PluginError, match="no agent named 'multi_turn_tools' is registered \\(registered: "
                                          "single_turn, tools\\)"):
        Run(cfg, load_plugins(["qwen3", "grpo", "vllm", "tools"]))
