"""What the multi-process tests share: a tiny Qwen3 HF checkpoint (running rank scripts: ranks.py)."""
import pytest
import torch

TINY_QWEN3 = dict(vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=64, max_position_embeddings=32)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A random tiny Qwen3 checkpoint written by transformers (its config: ``TINY_QWEN3``), in several files with an
    index, as published checkpoints come."""
    from rlcore_model_qwen3.plugin import QWEN3
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3") / "ckpt"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3.tiny_hf_config(**TINY_QWEN3))).float()
    model.save_pretrained(path, max_shard_size="40KB")
    return path
