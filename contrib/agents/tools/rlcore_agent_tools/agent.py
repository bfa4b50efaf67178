"""The ``tools`` agent: the policy answers, calls an environment's tools, reads their results and answers again, for
up to ``agent.max_turns`` turns. What it trains on is exactly what the engine sampled: each turn's tokens are kept as
sampled (decoded only to find the tool calls), and what comes between turns is the chat template's suffix
(``ChatTokens.observation``), loss-masked. A template that cannot be extended exactly starts a new training sample
from the re-rendered conversation instead of training on drifted tokens (counted in ``agent/split_samples``).

Every failure of a tool (an unknown name, arguments that do not fit, an exception, a timeout) becomes an error
observation the model reads, counted per tool; the episode goes on. Environment state lives in the episode (one
environment per episode), so a checkpoint has nothing of it to keep."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict

from rlcore.errors import ConfigError, RlcoreError
from rlcore.specs import Agent, AgentSpec, RolloutBackend, Sampling
from rlcore.trajectory import Trajectory
from rlcore_agent_tools.chat import ChatTokens, Transcript
from rlcore_agent_tools.hermes import ToolCall, content_before_calls
from rlcore_agent_tools.metrics import agent_metrics
from rlcore_agent_tools.tools import Tool, environment_tools, tool_result_text

TOOL_THREADS = 32       # tools run on threads of the agent's own; a timed-out tool's thread may run on (Python cannot
                        # stop it), so there are more of them than a step keeps busy


@dataclass
class AgentConfig:
    """The ``agent:`` section of a run with rollout.agent=tools: turns of the policy's output and an environment's tool
    results, all within rollout.max_response_len tokens (sampled and observed) per episode."""
    environment: str = ""         # a registered environment (rlcore_environments): one per episode, its methods tools
    options: Dict[str, Any] = field(default_factory=dict)   # given to the environment's make
    parser: str = "hermes"        # how tool calls are written in the output (a registered tool parser)
    max_turns: int = 4            # assistant turns per episode
    max_tool_response_tokens: int = 256   # a longer tool result is cut in the middle (agent/truncated_results)
    max_parallel_calls: int = 1   # tool calls run per turn; the rest are answered with an error the model reads
    tool_timeout_s: float = 10.0  # a tool still running after this is answered with a timeout error
    template_kwargs: Dict[str, Any] = field(default_factory=dict)   # for the chat template: {enable_thinking: false}

    def __post_init__(self) -> None:
        for key, ok, allowed in (
                ("max_turns", self.max_turns >= 1, "an integer >= 1"),
                ("max_tool_response_tokens", self.max_tool_response_tokens >= 2,
                 "an integer >= 2 (a result is cut to its head and tail)"),
                ("max_parallel_calls", self.max_parallel_calls >= 1, "an integer >= 1"),
                ("tool_timeout_s", self.tool_timeout_s > 0, "a number of seconds > 0")):
            if not ok:
                raise ConfigError(f"config key 'agent.{key}' = {getattr(self, key)!r} is not allowed: use {allowed}")


@dataclass
class EpisodeStats:
    """What one episode did, kept in its trajectory's metadata["agent"] (summed into the step's metrics)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)      # tool name -> calls that failed (timeouts apart)
    tool_timeouts: Counter = field(default_factory=Counter)
    tool_seconds: float = 0.0
    observation_tokens: int = 0
    truncated_results: int = 0          # tool results cut to agent.max_tool_response_tokens
    cut_by_budget: bool = False         # the episode ran out of rollout.max_response_len tokens between turns
    split_samples: int = 0              # training samples started anew because the template could not be extended

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tool_errors": dict(self.tool_errors),
                "tool_timeouts": dict(self.tool_timeouts)}


class ToolAgent(Agent):
    """One environment per episode (``make_env``); its documented methods are the tools the chat template offers."""

    def __init__(self, tokenizer, chat: ChatTokens, make_env: Callable[[], Any], parse: Callable[[str], list[ToolCall]],
                 cfg, max_len: int):
        self.tokenizer, self.chat, self.make_env, self.parse, self.cfg = tokenizer, chat, make_env, parse, cfg
        self.max_len = max_len          # the model's context: an episode's prompt and every token after it
        self.pool = concurrent.futures.ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="rlcore-tool")

    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> list[Trajectory]:
        env = self.make_env()
        tools = environment_tools(env)
        schemas = [tool.schema() for tool in tools.values()] or None
        messages = list(_messages(metadata))
        first = env.reset(**{k: v for k, v in metadata.items() if k != "messages"})
        if first:
            messages.append({"role": "user", "content": first})
        stats = EpisodeStats()
        samples = [Transcript(self._first_prompt(messages, schemas, sampling.max_tokens))]
        budget, finish, versions = sampling.max_tokens, "stop", [engine.version, engine.version]
        # turn t is seeded seed + 7919 t: sample j of a prompt has seed + j, so a prime stride keeps turns apart
        for turn in range(self.cfg.max_turns):
            done = await engine.generate(samples[-1].tokens, dataclasses.replace(sampling, max_tokens=budget),
                                         None if seed is None else seed + 7919 * turn, f"{request_id}-turn{turn}")
            versions = [min(versions[0], done.versions[0]) if turn else done.versions[0], done.versions[1]]
            samples[-1].sampled(done.tokens, done.logprobs, done.routed_experts)
            stats.turns, budget, finish = turn + 1, budget - len(done.tokens), done.finish_reason
            text = self.tokenizer.decode(done.tokens, skip_special_tokens=True)
            calls = self.parse(text) if finish == "stop" else []
            if not calls or turn + 1 == self.cfg.max_turns:
                break
            messages.append(_assistant(text, calls))
            results = await self._call_all(calls, tools, stats)
            observed = [self._tool_message(call, result, stats) for call, result in zip(calls, results)]
            closing = self.chat.close(done.tokens)
            delta = self.chat.observation(observed, schemas, history=messages)
            messages.extend(observed)
            if delta is None:            # not an exact suffix: a new sample from the conversation as rendered
                stats.split_samples += 1
                samples[-1].inserted(closing)
                samples.append(Transcript(self.chat.prompt(messages, schemas)))
                delta, closing = [], []
            if len(closing) + len(delta) >= budget:     # no room left to answer after the results
                stats.cut_by_budget, finish = True, "length"
                break
            samples[-1].inserted(closing + delta)
            budget -= len(closing) + len(delta)
            stats.observation_tokens += len(closing) + len(delta)
        extra = {"agent": stats.as_dict(), "final_response": text}
        if callable(getattr(env, "reward", None)):
            extra["environment_reward"] = env.reward()
        if callable(getattr(env, "close", None)):
            env.close()
        return [s.trajectory(version=(versions[0], versions[1]), finish=finish, metadata={**metadata, **extra})
                for s in samples]

    def _first_prompt(self, messages: list[dict], schemas: list[dict] | None, budget: int) -> list[int]:
        ids = self.chat.prompt(messages, schemas)
        if len(ids) + budget > self.max_len:
            raise RlcoreError(f"the tools agent's prompt has {len(ids)} tokens (the task's messages with "
                              f"{len(schemas or [])} tool schema(s)); with rollout.max_response_len {budget} it "
                              f"exceeds the model's context {self.max_len}. Shorten the prompts or the tools' "
                              f"docstrings, or lower rollout.max_response_len")
        return ids

    async def _call_all(self, calls: list[ToolCall], tools: dict[str, Tool], stats: EpisodeStats) -> list[str]:
        """Each call's result text, at most agent.max_parallel_calls of them at once (the rest get an error)."""
        limit = self.cfg.max_parallel_calls
        stats.tool_calls += len(calls)
        results = await asyncio.gather(*(self._call(call, tools, stats) for call in calls[:limit]))
        over = [f"error: only {limit} tool call(s) per turn are run; this one was not" for _ in calls[limit:]]
        for call in calls[limit:]:
            stats.tool_errors[call.name or "malformed"] += 1
        return [*results, *over]

    async def _call(self, call: ToolCall, tools: dict[str, Tool], stats: EpisodeStats) -> str:
        tool = tools.get(call.name)
        problem = call.error or ("" if tool else f"unknown tool {call.name!r}; the tools are {sorted(tools)}") \
            or tool.check(call.arguments)                       # type: ignore[union-attr]
        if problem:
            stats.tool_errors[call.name or "malformed"] += 1
            return f"error: {problem}"
        assert tool is not None
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(tool.call):
                result = await asyncio.wait_for(tool.call(**call.arguments), self.cfg.tool_timeout_s)
            else:
                loop = asyncio.get_running_loop()
                result = await asyncio.wait_for(loop.run_in_executor(self.pool, lambda: tool.call(**call.arguments)),
                                                self.cfg.tool_timeout_s)
            return tool_result_text(result)
        except asyncio.TimeoutError:
            stats.tool_timeouts[call.name] += 1
            return f"error: {call.name} took longer than {self.cfg.tool_timeout_s:g} s and was stopped"
        except Exception as e:          # the tool's own failure is an observation, not the run's
            stats.tool_errors[call.name] += 1
            return f"error: {call.name} raised {type(e).__name__}: {e}"
        finally:
            stats.tool_seconds += time.perf_counter() - start

    def _tool_message(self, call: ToolCall, result: str, stats: EpisodeStats) -> dict:
        """The result as the model reads it: at most agent.max_tool_response_tokens tokens, a longer one cut in the
        middle (its head, a note of how much was cut, its tail)."""
        ids = self.tokenizer.encode(result, add_special_tokens=False)
        limit = self.cfg.max_tool_response_tokens
        if len(ids) > limit:
            stats.truncated_results += 1
            note = f"\n...({len(ids)} tokens, cut)...\n"
            room = max(0, limit - len(self.tokenizer.encode(note, add_special_tokens=False)))
            head, tail = ids[:(room + 1) // 2], ids[len(ids) - room // 2:] if room > 1 else []
            result = f"{self.tokenizer.decode(head)}{note}{self.tokenizer.decode(tail)}"
        return {"role": "tool", "name": call.name, "content": result}


def _messages(metadata: dict) -> list[dict]:
    messages = metadata.get("messages")
    if not messages:
        raise ConfigError("rollout.agent=tools needs each task row's chat messages in its metadata['messages'] (the "
                          "dataset task and the built-in tool tasks give them); this task gives none")
    return messages


def _assistant(text: str, calls: list[ToolCall]) -> dict:
    """The turn as a chat message (for a template that must re-render the conversation), with the calls it made."""
    return {"role": "assistant", "content": content_before_calls(text),
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls if not c.error]}


def check_tool_agent(agent_cfg: AgentConfig, registry) -> None:
    """The environment and parser the section names are registered (before any worker or engine starts)."""
    if not agent_cfg.environment:
        raise ConfigError("rollout.agent=tools needs agent.environment: the name of a registered environment "
                          f"(registered: {', '.join(sorted(registry.table('environments'))) or 'none'})")
    registry.get("environments", agent_cfg.environment)
    registry.get("tool_parsers", agent_cfg.parser)


def build_tool_agent(model_path: str, cfg, registry, agent_cfg: AgentConfig) -> ToolAgent:
    from transformers import AutoTokenizer

    check_tool_agent(agent_cfg, registry)
    env_spec = registry.get("environments", agent_cfg.environment)
    parser = registry.get("tool_parsers", agent_cfg.parser)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    options = dict(agent_cfg.options)
    with open(os.path.join(model_path, "config.json")) as f:
        max_len = json.load(f)["max_position_embeddings"]
    return ToolAgent(tokenizer, ChatTokens(tokenizer, **dict(agent_cfg.template_kwargs)),
                     lambda: env_spec.make(options), parser.parse, agent_cfg, max_len)


TOOLS = AgentSpec("tools", build_tool_agent, config_cls=AgentConfig, check=check_tool_agent, metrics=agent_metrics)
