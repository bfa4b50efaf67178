"""Shared, expensive fixtures: one short quickstart run (real megatron-core, real vLLM) per test process (each
pytest-xdist worker whose tests use it), its warm start built once for the whole run."""
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from runs import SHORT_QUICKSTART, build_warm_start_cache  # noqa: E402  (tests/ is on sys.path for its conftest)


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """This test process's warm-start cache, holding the quickstart's starting checkpoint from the start, built once
    for the whole test run (``runs.build_warm_start_cache``)."""
    return build_warm_start_cache(tmp_path_factory, "quickstart", ["qwen3", "grpo", "vllm"])


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
