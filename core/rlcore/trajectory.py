"""The trajectory: one episode, the unit that flows from the rollout side to the learning side.

An episode is any number of turns, so it is kept flat: ``tokens`` (the prompt, what the policy sampled, and any
observation or tool tokens in between), with ``loss_mask`` true only where the policy sampled the token and the
behaviour ``logprobs`` aligned with the tokens. Nothing here assumes one prompt followed by one contiguous response,
or that the current weights sampled it: ``version`` records the weights that did (the oldest and the newest, when
an episode spans a weight push). ``to_batch`` turns trajectories into the training batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlcore.data import Batch
from rlcore.routed_experts import ROUTED_EXPERTS, batch_routes


@dataclass
class Trajectory:
    tokens: list[int]
    loss_mask: list[bool]            # per token: the policy sampled it (trained on); prompt and observations: False
    logprobs: list[float]            # per token: the behaviour policy's logprob where sampled, 0.0 elsewhere
    group: int = 0                   # trajectories of one prompt share a group (advantages compare within it)
    version: tuple[int, int] = (0, 0)   # the weights that sampled it: oldest, newest
    finish: str = "stop"             # stop | length | abort
    reward: float = 0.0              # the training reward (a failed reward filled in neutrally, see rewards.py)
    failed: bool = False             # the reward failed: trained on nothing
    metadata: dict = field(default_factory=dict)
    continues: bool = False          # a later sample of the previous trajectory's episode (an agent split it): scored
                                     # as one episode with it, each sample trained with the episode's reward
    routed_experts: torch.Tensor | None = None   # [tokens fed, MoE layers, top_k]: the engine's routes of its first
                                     # tokens (rlcore.routed_experts), for the learner to replay

    def __post_init__(self):
        if not len(self.tokens) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError(f"a trajectory's tokens ({len(self.tokens)}), loss_mask ({len(self.loss_mask)}) and "
                             f"logprobs ({len(self.logprobs)}) must align")
        if self.routed_experts is not None and len(self.routed_experts) > len(self.tokens):
            raise ValueError(f"a trajectory's routed experts cover {len(self.routed_experts)} tokens but it has "
                             f"{len(self.tokens)}")

    @staticmethod
    def single_turn(prompt: Sequence[int], response: Sequence[int], logprobs: Sequence[float], **fields
                    ) -> "Trajectory":
        """A prompt and one sampled response."""
        return Trajectory(tokens=[*prompt, *response], loss_mask=[False] * len(prompt) + [True] * len(response),
                          logprobs=[0.0] * len(prompt) + list(logprobs), **fields)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first sampled one (all of them if none was sampled)."""
        return next((i for i, sampled in enumerate(self.loss_mask) if sampled), len(self.tokens))

    @property
    def response_len(self) -> int:
        """Tokens from the first sampled one on (observations between turns included)."""
        return len(self.tokens) - self.prompt_len


def episode_samples(result: "Trajectory | list[Trajectory]") -> list[Trajectory]:
    """What an agent's ``run`` returned as the episode's training samples, the later ones marked ``continues``."""
    samples = result if isinstance(result, list) else [result]
    for later in samples[1:]:
        later.continues = True
    return samples


def episodes_of(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories in sample order grouped into their episodes (a split episode's samples are consecutive)."""
    out: list[list[Trajectory]] = []
    for t in trajectories:
        if t.continues and out:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def to_batch(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """The training batch: right-padded ``input_ids``; per-token tensors aligned with *label* positions (position
    t scores token t + 1): ``response_mask`` (the loss mask; a failed trajectory trains nothing) and
    ``rollout_logprobs``; per row ``prompt_len``, ``response_len``, ``rewards``, ``group_ids`` and ``version``
    (the oldest weights that sampled it: a row is on-policy only if all of it is); ``ROUTED_EXPERTS`` by token
    position when trajectories carry routes. ``meta`` holds each trajectory's metadata."""
    n = len(trajectories)
    width = max(len(t.tokens) for t in trajectories)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        length = len(t.tokens)
        input_ids[i, :length] = torch.tensor(t.tokens, dtype=torch.long)
        if not t.failed:          # label position j - 1 scores token j
            loss_mask[i, : length - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
        logprobs[i, : length - 1] = torch.tensor(t.logprobs[1:], dtype=torch.float32)
    tensors = {"input_ids": input_ids, "response_mask": loss_mask,
               "prompt_len": torch.tensor([t.prompt_len for t in trajectories]),
               "response_len": torch.tensor([t.response_len for t in trajectories]),
               "rollout_logprobs": logprobs,
               "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
               "group_ids": torch.tensor([t.group for t in trajectories], dtype=torch.long),
               "version": torch.tensor([t.version[0] for t in trajectories], dtype=torch.long)}
    routes = batch_routes([t.routed_experts for t in trajectories], width)
    if routes is not None:
        tensors[ROUTED_EXPERTS] = routes
    return Batch(tensors, [t.metadata for t in trajectories])
