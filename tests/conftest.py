"""Shared, expensive fixtures: one short quickstart run (real megatron-core, real vLLM) per test process (each
pytest-xdist worker whose tests use it), from the warm start the repository's conftest.py builds once for the whole
run; each test that asks for the run gets it restored to the state its training ended in."""
import pytest

# the repository's conftest.py puts tests/ on sys.path, and holds warm_start_cache
from runs import SHORT_QUICKSTART, prepared_model


@pytest.fixture(scope="session")
def quickstart_model(warm_start_cache) -> str:
    """The quickstart's starting checkpoint (its warm start: an HF directory), as its runs find it in the cache."""
    return prepared_model("quickstart", warm_start_cache, ["qwen3", "grpo", "vllm"])


@pytest.fixture(scope="session")
def trained_quickstart(tmp_path_factory, warm_start_cache):
    """A Run that has run the short quickstart, and the checkpoint of the state it ended in; its actor and vLLM
    engine stay up for further checks."""
    import torch

    from rlcore.checkpoint import complete_checkpoints
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.run import Run

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("quickstart")
    cfg = load_config("quickstart", SHORT_QUICKSTART + [f"run.dir={root / 'run'}",
                                                        f"warm_start.cache_dir={warm_start_cache}"])
    run = Run(cfg, load_plugins(["qwen3", "grpo", "vllm"]))
    run.summary = run.train()
    run.save_checkpoint(cfg.trainer.steps, run.eval_before)
    run.checkpointer.finish(blocking=True)
    [(_, saved)] = complete_checkpoints(run.run_dir)[-1:]
    yield run, saved
    run.close()


@pytest.fixture
def quickstart(trained_quickstart):
    """The session's quickstart run as its training left it, for one test: restored from that state's checkpoint
    (weights, optimizer, generators, the prompt sampler, the learner's version) and its engine made to take those
    weights again, so that no test sees what another did to the run (trained it on, pushed other weights)."""
    run, saved = trained_quickstart
    run.restore(saved)
    for worker in run.workers.workers:       # one in-process worker
        worker.engine.synced_version = -1
    run.source.sync()                        # rollout mode: the engine takes the restored weights
    return run
