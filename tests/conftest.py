"""Shared, expensive fixtures: one short quickstart run (real megatron-core, real vLLM) per test session."""
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A short quickstart: the preset's model, task and algorithm, fewer RL steps.
SHORT_QUICKSTART = ["trainer.steps=50", "trainer.eval_every=0", "run.progress=false"]


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """One warm-start cache per test session: the quickstart's supervised warm start runs once."""
    return tmp_path_factory.mktemp("warm_start_cache")


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory, warm_start_cache):
    """A Run that has run the short quickstart; its actor and vLLM engine stay up for further checks."""
    import torch

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.run import Run

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("quickstart")
    cfg = load_config("quickstart", SHORT_QUICKSTART + [f"run.dir={root / 'run'}",
                                                        f"warm_start.cache_dir={warm_start_cache}"])
    run = Run(cfg, load_plugins(["qwen3", "grpo", "vllm"]))
    run.summary = run.train()
    yield run
    run.close()


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE tokenizer trained here, with Qwen3's special tokens and a Qwen3-style chat template."""
    from rlcore.testing_gsm8k import chat_tokenizer

    return chat_tokenizer()
