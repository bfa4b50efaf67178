"""A scalar reward model on Megatron: a model family's GPTModel whose vocabulary projection is replaced by the
checkpoint's score head (transformers' ``*ForSequenceClassification``: ``score.weight`` [1, hidden], no bias), read
at each sequence's last token as transformers reads it. The family's own weight rules load everything else."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rlcore.config.schema import TrainedModelConfig
from rlcore.convert import Rename
from rlcore.converted import ConvertedWeights
from rlcore.data import Batch
from rlcore.hf_checkpoint import HFCheckpoint
from rlcore.megatron.heads import with_scalar_head
from rlcore.megatron.trainable import MegatronTrainable
from rlcore.specs import ModelSpec, OptimizerSpec

SCORE_WEIGHT = "score.weight"          # the head's name in an HF sequence-classification checkpoint
SCORE_RULE = Rename("output_layer.weight", SCORE_WEIGHT)      # the same on every TP rank


def classifier_architecture(causal: str) -> str:
    """transformers' sequence classifier of a causal LM architecture (LlamaForCausalLM ->
    LlamaForSequenceClassification)."""
    return causal.replace("ForCausalLM", "ForSequenceClassification")


def family_of(models: dict[str, ModelSpec], hf_config: dict) -> ModelSpec:
    """The registered family of a sequence classifier (``XForSequenceClassification`` of the family's
    ``XForCausalLM``) or of its causal LM (what a reward model is trained from); a ValueError naming the
    architecture and the classifiers rlcore can load otherwise."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    for spec in models.values():
        if arch in {classifier_architecture(a) for a in spec.hf_architectures} | set(spec.hf_architectures):
            return spec
    known = sorted(classifier_architecture(a) for s in models.values() for a in s.hf_architectures
                   if a.endswith("ForCausalLM"))
    raise ValueError(f"it holds a {arch} checkpoint, not a sequence classifier of a model family rlcore has (the "
                     f"installed families give: {', '.join(known) or 'none'})")


def check_classifier_config(models: dict[str, ModelSpec], hf_config: dict, dtype: str = "float32") -> ModelSpec:
    """What a reward model's config.json must say (a dry run, planning for another machine, has only that): a
    sequence classifier of an installed family, whose own checks its config passes, one label wide; its family, or a
    ValueError saying what is wrong."""
    from rlcore.megatron.model import check_model_config

    spec = family_of(models, hf_config)
    arch = hf_config["architectures"][0]
    if arch in spec.hf_architectures:
        raise ValueError(f"it holds a {arch} checkpoint, a causal LM: a reward model is its sequence classifier "
                         f"({classifier_architecture(arch)}); train one from it with rlcore train-rm")
    labels = len(hf_config["id2label"]) if hf_config.get("id2label") else hf_config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"its score head is {labels} labels wide (config.json's id2label/num_labels): a reward "
                         f"model gives one score, num_labels=1")
    check_model_config(spec, {**hf_config, "architectures": list(spec.hf_architectures[:1])}, dtype)
    return spec


def check_reward_model(models: dict[str, ModelSpec], hf_config: dict, path: str, dtype: str = "float32"
                       ) -> ModelSpec:
    """A sequence classifier rlcore can score with, before any worker starts: its config as
    ``check_classifier_config`` wants it, and its score head in the files, [1, hidden]."""
    spec = check_classifier_config(models, hf_config, dtype)
    files = HFCheckpoint(path, hf_config)
    if SCORE_WEIGHT not in files:
        raise ValueError(f"its weights have no score head ({SCORE_WEIGHT}): it is not a trained sequence classifier "
                         f"(a causal LM checkpoint would need one trained: rlcore train-rm)")
    shape = files.stored(SCORE_WEIGHT).shape
    if tuple(shape) != (1, hf_config["hidden_size"]):
        raise ValueError(f"its score head {SCORE_WEIGHT} has shape {list(shape)}, not [1, hidden_size = "
                         f"{hf_config['hidden_size']}]: a reward model gives one score")
    return spec


def score_positions(sequences: list[list[int]], pad_id: int | None) -> list[int]:
    """Where transformers' sequence classifiers read each sequence's score: at its rightmost token that is not the
    config's ``pad_token_id`` (so a sequence ending in that token, an end of sequence that is also the pad, is read
    before it; at 0 if every token is it), or at its last token where the config has no pad token."""
    positions = []
    for tokens in sequences:
        last = len(tokens) - 1
        while pad_id is not None and last > 0 and tokens[last] == pad_id:
            last -= 1
        positions.append(last if pad_id is None or tokens[last] != pad_id else 0)
    return positions


def score_batch(sequences: list[list[int]], pad_id: int | None) -> Batch:
    """Right-padded sequences to score, each with the position its score is read at (``score_index``). Padding
    follows each sequence, so under the causal mask it changes none of the positions read."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id or 0, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, tokens in enumerate(sequences):
        ids[i, :len(tokens)] = torch.tensor(tokens)
        mask[i, :len(tokens)] = 1
    lengths = torch.tensor([len(s) for s in sequences])
    return Batch({"input_ids": ids, "response_mask": mask, "prompt_len": lengths,
                  "response_len": torch.zeros_like(lengths),
                  "score_index": torch.tensor(score_positions(sequences, pad_id))})


def read_scores(per_token: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each row's score [N] from the model's per-token outputs [N, S]."""
    return per_token[torch.arange(len(batch)), batch["score_index"]]


@dataclass(frozen=True)
class NewScoreHead:
    """The rule that loads a causal LM's score head, which it has not: the head starts at 0 (no preference before
    any pair is seen)."""
    megatron: str = "output_layer.weight"
    tp_dim: int | None = None

    def hf_names(self) -> list[str]:
        return []

    def from_hf(self, hf, layout, tp_rank: int, tp_size: int, padded_shape: torch.Size) -> torch.Tensor:
        return torch.zeros(padded_shape)

    def to_hf(self, shards, layout):
        return SCORE_RULE.to_hf(shards, layout)

    def shard_to_hf(self, shard, hf, tp_rank: int, tp_size: int, layout):
        return SCORE_RULE.shard_to_hf(shard, hf, tp_rank, tp_size, layout)


def classifier_config(hf_config: dict, pad_token_id: int | None) -> dict:
    """The config.json of ``hf_config``'s model as a one-score sequence classifier, as transformers writes one."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    return {**hf_config, "architectures": [classifier_architecture(arch)], "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": pad_token_id}


class MegatronRewardModel(MegatronTrainable):
    role = "reward_model"

    def __init__(self, spec: ModelSpec, hf_config: dict, cfg: TrainedModelConfig, optimizer: OptimizerSpec | None,
                 hf_state: Mapping[str, torch.Tensor] | ConvertedWeights | None = None, seed: int = 0,
                 total_updates: int = 0):
        """``hf_state``: a sequence classifier's weights, or a causal LM's (its body; the score head starts at 0)."""
        self.head_rule = NewScoreHead() if isinstance(hf_state, HFCheckpoint) and SCORE_WEIGHT not in hf_state \
            else SCORE_RULE
        # a classifier has no LM head to tie to the embedding (megatron-core ties one across pipeline stages by an
        # all-reduce that needs CUDA)
        super().__init__(spec, {**hf_config, "tie_word_embeddings": False}, cfg, optimizer, hf_state, seed,
                         total_updates)
        self.converter = self.converter.replaced(SCORE_RULE)     # what it writes: its score head

    def structure(self):
        """The family's model with the score head in place of the output layer (on the last pipeline stage), and
        the family's rules with the score head's in place of the vocabulary projection's."""
        model, converter = super().structure()
        return with_scalar_head(model, bias=False), converter.replaced(self.head_rule)

    def token_outputs(self, values, labels, extras):
        return values.squeeze(-1).float(), {}

    def per_token_scores(self, batch: Batch) -> torch.Tensor:
        """The head's output at every position [N, S], on every rank (a row's score is read at its
        ``score_index``)."""
        return self.per_token(self.ddp, batch)

    def train_pairs(self, batch: Batch, total_pairs: float) -> dict[str, float]:
        """One Bradley-Terry update on this rank's share of a mini-batch of ``pair_batch`` rows (chosen, rejected,
        ...), the loss normalised by the mini-batch's ``total_pairs``."""
        from rlcore.losses import bradley_terry

        def loss_fn(values, mb):
            scores = read_scores(values, mb)
            real = mb["response_mask"][0::2].any(dim=1)       # filler rows (pipeline padding) pair up, unmasked
            return bradley_terry(scores[0::2], scores[1::2], real, total_pairs)

        return self.train_step(batch, loss_fn)

    def save_hf(self, directory: str, pad_token_id: int | None, max_shard_bytes: int = 5 * 10**9) -> None:
        """Collective: the model as an HF sequence classifier (``classifier_config``), written by global rank 0 as
        its weights stream by."""
        from rlcore.megatron.reshard import Resharder

        Resharder(self.model, self.converter).write_hf(classifier_config(self.hf_config, pad_token_id), directory,
                                                       max_shard_bytes)
