"""bench/async_throughput.py's long-tailed and slow-world workloads, as a plugin (``--plugins=...,long_tail
rollout.agent=long_tail task.reward=answer_before_tail``, or ``rollout.agent=slow_tool``; this folder on PYTHONPATH
makes it an installed distribution).

``slow_tool``: the episode answers as ``single_turn`` does, then calls a remote service (a judge, a search API, a
sandbox on another host) whose reply takes real wall time: TOOL_SECONDS for most calls, SLOW_SECONDS for LONG_SHARE
of them, drawn from the episode's seed. The engine and the trainer have nothing to do meanwhile; the reply adds
nothing to the trajectory, so the run learns exactly as the quickstart's. Evaluations (temperature 0) make no call.

The quickstart's tiny model answers an addition in a few tokens, so response length has to be made: the
``long_tail`` agent asks the engine for the answer as ``single_turn`` does, then draws a length L for the episode
(from its seed: 90 % uniform in [MEDIAN / 2, 3 MEDIAN / 2], 10 % LONG_FACTOR x MEDIAN) and, after one separator
token, asks the engine to continue the sequence for exactly L tokens (``min_tokens = max_tokens = L``: this model
would end at once with eos). Those are kept like an observation (loss mask false, logprob 0): the engine decodes
them, one decode step per token as a long response costs, and the trainer's forward and backward passes run over
them, but nothing learns from them, so the answer trains exactly as in the quickstart.

Held-out evaluation is greedy and reads only the answer: a greedy episode (temperature 0) gets no tail, so
evaluations cost the same in both workloads. ``answer_before_tail`` is the task's exact match on the answer's text
only (the agent records its length in the trajectory's metadata)."""
from __future__ import annotations

import asyncio
import json
import os
import random

from rlcore.hookspecs import hookimpl
from rlcore.specs import Agent, AgentSpec, RewardSpec, RolloutBackend, Sampling
from rlcore.trajectory import Trajectory

MEDIAN = 8             # tail tokens of the median episode
LONG_SHARE = 0.1       # episodes whose tail is LONG_FACTOR x MEDIAN
LONG_FACTOR = 10
SEPARATOR = "*"        # never part of an addition prompt or answer
TOOL_SECONDS = (0.1, 0.3)   # slow_tool: a call's reply time, uniform in this range, ...
SLOW_SECONDS = 1.0          # ... or this for LONG_SHARE of the calls


def tail_length(seed: int | str) -> int:
    """The episode's tail length, fixed by its seed."""
    rng = random.Random(f"long-tail/{seed}")
    if rng.random() < LONG_SHARE:
        return LONG_FACTOR * MEDIAN
    return rng.randint(MEDIAN // 2, 3 * MEDIAN // 2)


class LongTail(Agent):
    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        ids = self.tokenizer.encode(SEPARATOR, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"long_tail: the separator {SEPARATOR!r} is {len(ids)} tokens in {model_path}'s "
                             f"tokenizer; the agent needs a one-token separator (it is built for the addition task)")
        self.separator = ids[0]
        with open(os.path.join(model_path, "config.json")) as f:
            self.context = json.load(f)["max_position_embeddings"]

    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> Trajectory:
        answer = await engine.generate(prompt, sampling, seed, request_id)
        answered = {**metadata, "answer_chars": len(self.tokenizer.decode(answer.tokens, skip_special_tokens=True))}
        if sampling.temperature == 0:                     # evaluation: the answer is all it reads
            return Trajectory.single_turn(prompt, answer.tokens, answer.logprobs, version=answer.versions,
                                          finish=answer.finish_reason, metadata=answered)
        context = [*prompt, *answer.tokens, self.separator]
        want = min(tail_length(request_id if seed is None else seed), self.context - len(context))
        tail: list[int] = []
        if want > 0:
            more = Sampling(want, sampling.temperature, sampling.top_p, sampling.top_k, min_tokens=want)
            tail = (await engine.generate(context, more, None if seed is None else (seed + 7919) % 2**31,
                                          f"{request_id}/tail")).tokens
        observed = 1 + len(tail)
        context += tail
        # the versions are the answer's: its tokens are the ones trained on (the learner reads the newest as the
        # weights that sampled the row)
        return Trajectory(tokens=context, loss_mask=[False] * len(prompt) + [True] * len(answer.tokens)
                          + [False] * observed,
                          logprobs=[0.0] * len(prompt) + list(answer.logprobs) + [0.0] * observed,
                          version=answer.versions, finish=answer.finish_reason, metadata=answered)


def tool_seconds(seed: int | str) -> float:
    """How long the episode's call to the remote service takes, fixed by its seed."""
    rng = random.Random(f"slow-tool/{seed}")
    return SLOW_SECONDS if rng.random() < LONG_SHARE else rng.uniform(*TOOL_SECONDS)


class SlowTool(Agent):
    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> Trajectory:
        answer = await engine.generate(prompt, sampling, seed, request_id)
        if sampling.temperature > 0:                       # evaluation reads the answer alone
            await asyncio.sleep(tool_seconds(request_id if seed is None else seed))
        return Trajectory.single_turn(prompt, answer.tokens, answer.logprobs, version=answer.versions,
                                      finish=answer.finish_reason, metadata=metadata)


def answer_before_tail(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the answer (the response's first ``answer_chars`` characters), stripped, equals
    ``metadata['answer']``."""
    return [float(r[: m.get("answer_chars", len(r))].strip() == str(m["answer"])) for r, m in zip(responses, metadata)]


@hookimpl
def rlcore_agents():
    return [AgentSpec("long_tail", lambda model_path, cfg, registry: LongTail(model_path)),
            AgentSpec("slow_tool", lambda model_path, cfg, registry: SlowTool())]


@hookimpl
def rlcore_rewards():
    return [RewardSpec("answer_before_tail", answer_before_tail)]
