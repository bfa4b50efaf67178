"""Reward-model checkpoints for the tests, made by transformers from a causal LM checkpoint (the quickstart's): its
body, a random score head, saved as a sequence classifier with the tokenizer beside it."""
import json
import os

import torch


def classifier_from(causal_path, out, pad_token_id: int | None = None, seed: int = 0, num_labels: int = 1):
    """A ``*ForSequenceClassification`` checkpoint in ``out`` with ``causal_path``'s body and tokenizer and a random
    score head (std 1: scores of order 1); returns the transformers model (eval)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal_path, num_labels=num_labels,
                                                               pad_token_id=pad_token_id, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out, max_shard_size="1MB")
    AutoTokenizer.from_pretrained(causal_path).save_pretrained(out)
    return model.eval()


def with_permuted_vocabulary(path, out) -> None:
    """``path``'s reward model under another tokenizer: every token id reversed, in the tokenizer and in the
    embedding's rows alike, so that it scores every text exactly as ``path`` does, from other ids."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    embedding = model.get_input_embeddings().weight
    size = embedding.shape[0]
    with torch.no_grad():
        embedding.copy_(embedding.flip(0))
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if isinstance(getattr(model.config, key, None), int):
            setattr(model.config, key, size - 1 - getattr(model.config, key))
    model.save_pretrained(out, max_shard_size="1MB")
    with open(os.path.join(path, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    assert len(tokenizer["model"]["vocab"]) == size
    tokenizer["model"]["vocab"] = {token: size - 1 - i for token, i in tokenizer["model"]["vocab"].items()}
    for added in tokenizer.get("added_tokens", []):
        added["id"] = size - 1 - added["id"]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    for name in os.listdir(path):
        if name.startswith(("tokenizer_config", "special_tokens")):
            with open(os.path.join(path, name)) as src, open(os.path.join(out, name), "w") as dst:
                dst.write(src.read())
