"""The built-in agent: one response to the prompt, what every run did before agents existed."""
from __future__ import annotations

from rlcore.multimodal import IMAGES
from rlcore.specs import Agent, AgentSpec, RolloutBackend, Sampling
from rlcore.trajectory import Trajectory


class SingleTurn(Agent):
    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> Trajectory:
        images = metadata.get(IMAGES)       # a vision-language model's prompt: its images, decoded
        done = await (engine.generate_with_images(prompt, images, sampling, seed, request_id) if images else
                      engine.generate(prompt, sampling, seed, request_id))
        return Trajectory.single_turn(prompt, done.tokens, done.logprobs, version=done.versions,
                                      finish=done.finish_reason, metadata=metadata,
                                      routed_experts=done.routed_experts)


SINGLE_TURN = AgentSpec("single_turn", lambda model_path, cfg, registry: SingleTurn())
