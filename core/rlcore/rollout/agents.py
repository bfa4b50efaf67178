"""The built-in agent: one response to the prompt, what every run did before agents existed."""
from __future__ import annotations

from rlcore.specs import Agent, AgentSpec, RolloutBackend, Sampling
from rlcore.trajectory import Trajectory


class SingleTurn(Agent):
    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> Trajectory:
        done = await engine.generate(prompt, sampling, seed, request_id)
        return Trajectory.single_turn(prompt, done.tokens, done.logprobs, version=done.versions,
                                      finish=done.finish_reason, metadata=metadata)


SINGLE_TURN = AgentSpec("single_turn", lambda model_path, cfg, registry: SingleTurn())
