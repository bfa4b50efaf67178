"""A scalar reward model on Megatron: a model family's GPTModel whose vocabulary projection is replaced by the
checkpoint's score head (transformers' ``*ForSequenceClassification``: ``score.weight`` [1, hidden], no bias), read
at each sequence's last token as transformers reads it. The family's own weight rules load everything else."""
from __future__ import annotations

import torch

from rlcore.convert import Rename
from rlcore.data import Batch
from rlcore.megatron.heads import with_scalar_head
from rlcore.megatron.trainable import MegatronTrainable
from rlcore.specs import ModelSpec

SCORE_WEIGHT = "score.weight"          # the head's name in an HF sequence-classification checkpoint
SCORE_RULE = Rename("output_layer.weight", SCORE_WEIGHT)      # the same on every TP rank


def classifier_architecture(causal: str) -> str:
    """transformers' sequence classifier of a causal LM architecture (LlamaForCausalLM -> LlamaForSequenceClassification)."""
    return causal.replace("ForCausalLM", "ForSequenceClassification")


def family_of(models: dict[str, ModelSpec], hf_config: dict) -> ModelSpec:
    """The registered family whose causal LM the checkpoint's sequence classifier is built on; a ValueError naming
    the architecture and the classifiers rlcore can load otherwise."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    for spec in models.values():
        if arch in {classifier_architecture(a) for a in spec.hf_architectures}:
            return spec
        if arch in spec.hf_architectures:
            raise ValueError(f"it holds a {arch} checkpoint, a causal LM: a reward model is its sequence classifier "
                             f"({classifier_architecture(arch)}); train one from it with rlcore train-rm")
    known = sorted(classifier_architecture(a) for s in models.values() for a in s.hf_architectures
                   if a.endswith("ForCausalLM"))
    raise ValueError(f"it holds a {arch} checkpoint, not a sequence classifier of a model family rlcore has (the "
                     f"installed families give: {', '.join(known) or 'none'})")


def check_reward_model(models: dict[str, ModelSpec], hf_config: dict, path: str, dtype: str = "float32"
                       ) -> ModelSpec:
    """A sequence classifier rlcore can score with, before any worker starts: a classifier of an installed family
    (whose own checks its config passes), one label wide, with its score head in the files; its family, or a
    ValueError saying what is wrong."""
    from rlcore.hf_checkpoint import HFCheckpoint
    from rlcore.megatron.model import check_model_config

    spec = family_of(models, hf_config)
    labels = len(hf_config["id2label"]) if hf_config.get("id2label") else hf_config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"its score head is {labels} labels wide (config.json's id2label/num_labels): a reward "
                         f"model gives one score, num_labels=1")
    check_model_config(spec, {**hf_config, "architectures": list(spec.hf_architectures[:1])}, dtype)
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


class MegatronRewardModel(MegatronTrainable):
    role = "reward_model"

    def __init__(self, spec: ModelSpec, hf_config: dict, *args, **kwargs):
        # a classifier has no LM head to tie to the embedding (megatron-core ties one across pipeline stages by an
        # all-reduce that needs CUDA)
        super().__init__(spec, {**hf_config, "tie_word_embeddings": False}, *args, **kwargs)

    def structure(self):
        """The family's model with the score head in place of the output layer (on the last pipeline stage), and
        the family's rules with the score head's in place of the vocabulary projection's."""
        model, converter = super().structure()
        return with_scalar_head(model, bias=False), converter.replaced(SCORE_RULE)

    def token_outputs(self, values, labels, extras):
        return values.squeeze(-1).float(), {}

    def per_token_scores(self, batch: Batch) -> torch.Tensor:
        """The head's output at every position [N, S], on every rank (a row's score is read at its
        ``score_index``)."""
        return self.per_token(self.ddp, batch)
