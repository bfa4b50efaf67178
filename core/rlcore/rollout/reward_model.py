"""A reward model as one of the run's rewards: a ``RewardSpec`` that reads each episode's token sequence (prompt
and response) and has the reward model's workers score it (``rlcore.rollout.handles.RewardModelWorkers``). Where
the reward model's tokenizer is not the policy's, the sequence is decoded as the policy saw it (special tokens kept
as text) and encoded by the reward model's tokenizer, which reads its own special tokens back by name."""
from __future__ import annotations

import os

from rlcore.errors import ConfigError
from rlcore.rewards import RewardBroken
from rlcore.megatron.reward_model import check_reward_model, score_batch
from rlcore.rollout.handles import RewardModelWorkers
from rlcore.rollout.judge import GenerativeJudge, load_judge
from rlcore.specs import RewardSpec


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids for the same text: the same vocabulary, special tokens included."""
    return a.get_vocab() == b.get_vocab()


class ModelReward:
    """A reward model's scores, one per episode: its checkpoint is checked and its tokenizer loaded by ``use`` (at
    once when reward_model.path is given; once trained, when the run trains it first), its workers handed over by
    ``start``."""

    def __init__(self, name: str):
        self.name, self.path = name, ""
        self.tokenizer = None
        self.pad_id: int | None = None
        self.context = 0
        self.workers: RewardModelWorkers | None = None
        self.policy_tokenizer = None       # set when its tokens are not the reward model's

    def use(self, path: str, registry, dtype: str = "float32") -> None:
        """Score with the checkpoint in ``path``; one refused, in one line naming it, if rlcore cannot score with
        it."""
        from transformers import AutoTokenizer

        from rlcore.megatron.model import read_hf_config

        hf_config = read_hf_config(path)
        try:
            check_reward_model(registry.models, hf_config, path, dtype)
        except ValueError as e:
            raise ConfigError(f"reward_model.path {path}: {e}") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward_model.path {path} has no tokenizer transformers can load ({e}): save the "
                              f"reward model's tokenizer into it (tokenizer.save_pretrained)") from None
        self.path, self.pad_id = path, hf_config.get("pad_token_id")
        self.context = int(hf_config["max_position_embeddings"])

    def spec(self) -> RewardSpec:
        return RewardSpec(self.name, self, sequences=True)

    def start(self, workers: RewardModelWorkers, policy_tokenizer) -> None:
        self.workers = workers
        self.policy_tokenizer = None if same_tokenizer(policy_tokenizer, self.tokenizer) else policy_tokenizer

    def __call__(self, responses: list[str], metadata: list[dict],
                 sequences: list[list[int]]) -> list[float | Exception]:
        """Each sequence's score, all scored in one pass; one longer than the reward model's context fails alone
        (an exception in its place, which the composer counts with its length as the reason)."""
        if self.workers is None:
            raise RewardBroken(f"reward {self.name!r} is a reward model whose workers have not started")
        if self.policy_tokenizer is not None:
            sequences = [self.tokenizer.encode(self.policy_tokenizer.decode(s), add_special_tokens=False)
                         for s in sequences]
        fits = [i for i, s in enumerate(sequences) if len(s) <= self.context]
        out: list[float | Exception] = [
            ValueError(f"a sequence of {len(s)} tokens is longer than the reward model's context ({self.context}, "
                       f"max_position_embeddings of {self.path})") for s in sequences]
        if fits:
            scored = self.workers.scores(score_batch([sequences[i] for i in fits], self.pad_id)).tolist()
            for i, score in zip(fits, scored):
                out[i] = score
        return out


def load_model_reward(cfg, registry) -> ModelReward | GenerativeJudge | None:
    """The run's reward model, registered as the reward ``reward_model.name``: reward_model.path's (checked here,
    before any worker starts), or one the run trains first from reward_training's pairs (``use`` once trained);
    None without either. With reward_model.kind=generative, reward_model.path's judge (``rlcore.rollout.judge``)."""
    if cfg.reward_model.kind == "generative":
        return load_judge(cfg, registry)
    training = cfg.reward_training
    if not (cfg.reward_model.path or training.train_files or training.synthetic_pairs):
        return None
    reward = ModelReward(cfg.reward_model.name)
    if cfg.reward_model.path:
        reward.use(os.path.expanduser(cfg.reward_model.path), registry, cfg.reward_model.dtype)
    registry.add("rewards", reward.spec(), owner=f"reward_model.path={cfg.reward_model.path or '(trained first)'}")
    return reward
