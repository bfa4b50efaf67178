"""A reward model scoring the policy's episodes through its real workers (in-process Megatron), against
transformers' AutoModelForSequenceClassification: from the policy's own tokens, and re-tokenized under a reward
model whose tokenizer is not the policy's (every id permuted, its embedding with it: the same scores from other
ids). And what is refused before any worker starts."""
import json
import shutil

import pytest
import torch

from reward_models import classifier_from, with_permuted_vocabulary

PLUGINS = ["qwen3", "grpo", "vllm"]
TEXTS = ["12+34=46", "7+8=15", "99+1=100", "5+5=1", "60+7=67"]


def reward_of(path, *overrides):
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.rollout.reward_model import load_model_reward

    registry = load_plugins(PLUGINS).registry
    return load_model_reward(load_config("quickstart", [f"reward_model.path={path}", *overrides]), registry)


def test_scores_equal_transformers_from_the_policy_tokens_and_retokenized(quickstart_model, tmp_path):
    from transformers import AutoTokenizer

    from rlcore.config import load_config
    from rlcore.workers.proxies import RewardModelGroup

    reference = classifier_from(quickstart_model, tmp_path / "rm", pad_token_id=0)
    with_permuted_vocabulary(tmp_path / "rm", tmp_path / "rm_permuted")
    policy = AutoTokenizer.from_pretrained(quickstart_model)
    eos = policy.eos_token_id
    sequences = [policy.encode(t) + ([eos] if i % 2 else []) for i, t in enumerate(TEXTS)]   # eos = pad: read before
    width = max(map(len, sequences))
    with torch.no_grad():
        expected = reference(torch.tensor([s + [eos] * (width - len(s)) for s in sequences]),
                             attention_mask=torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
                             ).logits[:, 0]
    assert expected.std() > 0.1
    for name, retokenized in (("rm", False), ("rm_permuted", True)):
        path = tmp_path / name
        reward = reward_of(path)
        group = RewardModelGroup(load_config("quickstart", [f"reward_model.path={path}"]), PLUGINS, str(path),
                                 world=1)
        try:
            reward.start(group, policy)
            assert (reward.policy_tokenizer is not None) == retokenized
            scores = torch.tensor(reward([""] * len(TEXTS), [{}] * len(TEXTS), sequences))
            if not retokenized:     # a sequence past the model's context (64) fails alone, the others are scored
                *others, long = reward([""] * 3, [{}] * 3, [sequences[0], sequences[1], sequences[0] * 20])
                assert isinstance(long, ValueError) and "longer than the reward model's context (64" in str(long)
                assert torch.allclose(torch.tensor(others, dtype=torch.float64), scores[:2].double(), atol=1e-6)
        finally:
            group.stop()
        diff = (scores - expected).abs().max().item()
        assert diff < 1e-5, f"{name}: scores differ from transformers' by {diff}"


def test_unusable_reward_models_are_refused_in_one_line(quickstart_model, tmp_path):
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"reward_model.path .*Qwen3ForCausalLM checkpoint, a causal LM.*train-rm"):
        reward_of(quickstart_model)
    headless = tmp_path / "headless"         # a classifier's config over a causal LM's weights
    shutil.copytree(quickstart_model, headless)
    config = json.loads((headless / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"})
    (headless / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"reward_model.path .*weights have no score head \(score.weight\)"):
        reward_of(headless)
    classifier_from(quickstart_model, tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="2 labels wide"):
        reward_of(tmp_path / "two")
    with pytest.raises(ConfigError, match="reward_model.path .*does not exist"):
        reward_of(tmp_path / "missing")
