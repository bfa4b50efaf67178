"""What every rollout source does around its engines: prompts to tokens and back, episodes scored by the run's
rewards into groups. A source (colocated, queued) adds where the episodes run and how the loop gets its batch."""
from __future__ import annotations

import abc
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Callable

import torch

from rlcore.config import Config
from rlcore.errors import RlcoreError
from rlcore.multimodal import IMAGE_INPUTS, IMAGES, ImagePrompts
from rlcore.rewards import RewardComposer, Scores, SourceDispatch, neutral_fill
from rlcore.rollout.handles import Weights
from rlcore.specs import Sampling, Task
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory, episodes_of
from rlcore.weight_sync.logprob_check import ProbeImages, fixed_probe, with_image_prompts

log = logging.getLogger(__name__)


@dataclass
class StepRollout:
    """What a source gives the loop for a step: the trajectories to train on, grouped (``Trajectory.group``), the
    scores of everything sampled for the step, kept or not (the reward metrics), and the rollout side's metrics."""
    trajectories: list[Trajectory]
    scores: Scores
    metrics: dict[str, float]


class Source(abc.ABC):
    """Prompts from ``task`` → ``rollout.n`` episodes each of the run's agent → scored by ``rewards``; the groups
    ``keep_group`` accepts (dynamic sampling) train."""

    def __init__(self, cfg: Config, task: Task, tokenizer, max_len: int, rewards: RewardComposer | SourceDispatch,
                 keep_group: Callable[[torch.Tensor], bool],
                 agent_metrics: Callable[[list[Trajectory]], dict[str, float]] | None = None,
                 images: ImagePrompts | None = None):
        """``images``: how a vision-language model's prompts take their images (None: a text-only model)."""
        self.cfg, self.task, self.tokenizer = cfg, task, tokenizer
        self.rewards, self.keep_group, self.max_len = rewards, keep_group, max_len
        self.agent_metrics = agent_metrics           # the agent's (``AgentSpec.metrics``): turns, tool calls...
        self.images = images
        self.failure_reasons_seen: set[str] = set()

    # --- what a source provides ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int]) -> list[list[Trajectory]]:
        """``n`` episodes per prompt, one group per prompt, in prompt order, with the current weights."""

    @abc.abstractmethod
    def sync(self) -> dict[str, float]:
        """Bring the engines up to the learner's weights (no-op when they are); what the push moved."""

    @abc.abstractmethod
    def next_groups(self, step: int, version: int, timer: Timer) -> StepRollout:
        """The step's trajectories for the learner at ``version``, the scores of everything sampled for it (kept or
        not) and the rollout side's metrics; ``timer`` times the phases."""

    @abc.abstractmethod
    def push_weights(self, weights: Weights, version: int, step: int, timer: Timer | None = None) -> dict[str, float]:
        """The learner's ``weights`` are at ``version`` after ``step`` (0: before the first step; after a resume, the
        step it continues after): the engines get them when the source's schedule says; what the push measured.
        The first call comes before any episode is asked for."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollout side: the task's state (its prompt sampler), and the source's own."""
        return {"task": self.task.state_dict()}

    def resumed(self, step: int, version: int, state: dict) -> None:
        """The run continues after ``step`` from a checkpoint holding ``state``, the learner at ``version`` (the task's
        state is restored already)."""

    def close(self) -> None:
        """Stop what the source runs (threads, workers of its own)."""

    # --- tokens, rewards, metrics --------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        """What pads the batch's rows (the tokenizer's end of sequence)."""
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._fitting(self.tokenizer.encode(text, add_special_tokens=False), text)

    def encode_prompt(self, text: str, metadata: dict) -> tuple[list[int], dict]:
        """A row's prompt tokens and the metadata its episodes get: with images, each image's tokens in place of its
        ``<image>`` tag, the decoded images (``IMAGES``, for the engine) and their pixels (``IMAGE_INPUTS``, for the
        learner) in a copy of the row's metadata."""
        images = metadata.get(IMAGES)
        if images is None or len(images) == 0:
            return self.encode(text), metadata
        where = f"prompt {text[:40]!r}"
        if self.images is None:
            raise RlcoreError(f"{where} holds {len(images)} image(s) but model.family {self.cfg.model.family!r} is a "
                              f"text-only model; use a vision-language family (qwen2_vl) or rows without images")
        tokens, decoded, inputs = self.images.encode(text, images, where)
        return self._fitting(tokens, text, images=True), {**metadata, IMAGES: decoded, IMAGE_INPUTS: inputs}

    def _fitting(self, ids: list[int], text: str, images: bool = False) -> list[int]:
        if len(ids) + self.cfg.rollout.max_response_len > self.max_len:
            raise RlcoreError(f"prompt {text[:40]!r} has {len(ids)} tokens{' (its images included)' * images}; "
                              f"with rollout.max_response_len {self.cfg.rollout.max_response_len} it exceeds the "
                              f"model's context {self.max_len}. Shorten prompts"
                              f"{' (smaller images: the processor max_pixels)' * images} or lower "
                              f"rollout.max_response_len.")
        return ids

    @property
    def reserved_tokens(self) -> tuple[int, ...]:
        """Tokens no request samples and no engine check scores: a vision-language model's image placeholders."""
        return self.images.reserved if self.images is not None else ()

    def probe(self, seed: int) -> tuple[list[list[int]], list[list[int]], list[ProbeImages] | None]:
        """The engine check's fixed probe: prompts, responses, and for a vision-language model image prompts too."""
        text = fixed_probe(len(self.tokenizer), seed=seed, excluded=self.reserved_tokens)
        return (*text, None) if self.images is None else with_image_prompts(text, self.images, seed)

    def sampling(self, temperature: float) -> Sampling:
        """How the run's requests sample."""
        return Sampling(self.cfg.rollout.max_response_len, temperature, banned_token_ids=self.reserved_tokens)

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)          # one sequence in, one string out
        return text

    def score(self, texts: list[str], meta: list[dict], sequences: list[list[int]] | None = None) -> Scores:
        scores = self.rewards(texts, meta, sequences)
        for reason, count in scores.reasons.items():
            if reason not in self.failure_reasons_seen:   # each reason once; counts go to the metrics
                self.failure_reasons_seen.add(reason)
                log.warning("reward failed for %d sample(s), marked failed and left out of the loss: %s", count,
                            reason)
        return scores

    def scored(self, groups: list[list[Trajectory]], timer=None) -> Scores:
        """Score the groups' episodes (the responses of a split episode's samples read as one), setting each
        trajectory's group (its index here), reward (a failed one: its group's neutral fill) and failure; returns
        the episodes' scores in order."""
        timer = timer or (lambda phase: contextlib.nullcontext())
        episodes = [(g, episode) for g, group in enumerate(groups) for episode in episodes_of(group)]
        with timer("reward"):
            scores = self.score(["".join(self.decode(t.tokens[t.prompt_len:]) for t in episode)
                                 for _, episode in episodes], [episode[0].metadata for _, episode in episodes],
                                [episode_sequence(episode) for _, episode in episodes])
        group_ids = torch.tensor([g for g, _ in episodes])
        rewards = neutral_fill(scores.total, scores.failed, group_ids).float()
        for row, (g, episode) in enumerate(episodes):
            for t in episode:
                t.group, t.reward, t.failed = g, float(rewards[row]), bool(scores.failed[row])
        return scores

    def trajectory_metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """The agent's metrics of the trajectories a step trains on (none for an agent without them)."""
        return self.agent_metrics(trajectories) if self.agent_metrics else {}

    def groups(self, prompts: list[tuple[str, dict]], n: int, temperature: float, seeds: list[int],
               timer=None) -> tuple[list[list[Trajectory]], Scores]:
        """``n`` scored episodes of the run's agent for each prompt (sampled with its seed at ``temperature``), one
        group per prompt, and their scores in that order; ``timer`` times the phases (rollout, reward)."""
        timer = timer or (lambda phase: contextlib.nullcontext())
        encoded = [self.encode_prompt(p, m) for p, m in prompts]
        with timer("rollout"):
            groups = self.episodes([tokens for tokens, _ in encoded], [meta for _, meta in encoded], n,
                                   self.sampling(temperature), seeds)
        return groups, self.scored(groups, timer)


def episode_sequence(episode: list[Trajectory]) -> list[int]:
    """An episode's whole token sequence: its prompt, then every sample's response tokens (one sample's, unless the
    agent split the episode)."""
    first = episode[0]
    return first.tokens[:first.prompt_len] + [token for t in episode for token in t.tokens[t.prompt_len:]]


def prompt_seeds(count: int, run_seed: int, *where) -> list[int]:
    """One rollout seed for each of ``count`` prompts, fixed by the run's seed and where the prompts are drawn
    (``"train", step, round`` / ``"eval", step``): a resumed run samples exactly what the uninterrupted one did."""
    key = "/".join(map(str, (run_seed, *where)))
    return [random.Random(f"{key}/{i}").getrandbits(31) for i in range(count)]
