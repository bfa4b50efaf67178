"""Shared, expensive fixtures: one short quickstart run (real megatron-core, real vLLM) per test process (each
pytest-xdist worker whose tests use it), its warm start built once for the whole run."""
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from runs import SHORT_QUICKSTART  # noqa: E402  (tests/ is on sys.path for its conftest)


def shared_tmp(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this test run sees (the workers' base temps are its subfolders);
    without xdist, this process's base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """This test process's warm-start cache, holding the quickstart's starting checkpoint from the start. That entry,
    which most runs start from, is built once for the whole test run: under a file lock in a folder every xdist
    worker sees, by the first worker to get here, while the other waits; each worker gets a copy (4 MB). The cache
    itself is not shared: rlcore publishes an entry it has built by removing any entry of the same settings and
    renaming its own into place, so two workers building the same settings at once would remove one from under the
    other's runs."""
    return _warm_start_cache(tmp_path_factory, "quickstart")


@pytest.fixture(scope="session")
def tool_warm_start_cache(tmp_path_factory):
    """The same for the tool-calculator preset, whose starting checkpoint has settings (and so a cache entry) of its
    own: its task, tokenizer, context and warm start."""
    return _warm_start_cache(tmp_path_factory, "tool-calculator")


def _warm_start_cache(tmp_path_factory, preset: str) -> Path:
    from filelock import FileLock

    shared = shared_tmp(tmp_path_factory) / f"warm_start_{preset}"
    with FileLock(f"{shared}.lock"):
        built = _prepare_model(preset, shared)
    cache = tmp_path_factory.mktemp(f"warm_start_cache_{preset}")
    shutil.copytree(built, cache / os.path.basename(built))
    return cache


def _prepare_model(preset: str, cache) -> str:
    """The preset's starting checkpoint in ``cache`` (at once when cached), as its runs prepare it; its path."""
    import torch

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.rewards import build_rewards
    from rlcore.warm_start import prepare_model

    cfg = load_config(preset, [f"warm_start.cache_dir={cache}"])
    registry = load_plugins(["qwen3", "grpo", "vllm"]).registry
    task_spec = registry.get("tasks", cfg.task.name)
    task = task_spec.build(dict(cfg.task.options), cfg.run.seed)
    with torch.random.fork_rng():       # the worker's random state stays as the tests after it expect
        return prepare_model(cfg, registry.get("models", cfg.model.family), task,
                             build_rewards(cfg.task, task_spec.default_reward, task.data_sources(), registry))


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
    from rlcore.testing.gsm8k import chat_tokenizer

    return chat_tokenizer()
