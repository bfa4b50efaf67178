"""`rlcore convert`: the quickstart's HF checkpoint written once at TP2 x PP2 in Megatron's distributed format. Read
back in one process it equals the HF files bit for bit; a run started from it, at TP1 and at TP2 x PP2, takes the
same first step as the run started from the HF checkpoint (every metric but timings), its engine started without
weights and given the actor's at the first push (the engine check passes)."""
import json
import os
import sys

import pytest
import torch
from runs import ON_REQUEST, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TP2XPP2 = ["trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.pp=2"]


@pytest.fixture(scope="module")
def converted(quickstart_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    result = run_cli([sys.executable, "-m", "rlcore.cli", "convert", quickstart_model, str(out), "--tp=2",
                      "--pp=2", "--dtype=float32", "--plugins=qwen3"], timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return quickstart_model, str(out)


def test_converted_weights_equal_the_hf_files(converted):
    from rlcore.export import checkpoint_hf_weights
    from rlcore.converted import WEIGHTS
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel
    from rlcore.plugins import load_plugins

    hf_dir, out = converted
    with open(os.path.join(out, "rlcore_converted.json")) as f:
        assert json.load(f)["layout"] == {"tp": 2, "pp": 2, "ep": 1}
    init_parallel()
    spec = load_plugins(["qwen3"]).registry.get("models", "qwen3")
    _, stream = checkpoint_hf_weights(os.path.join(out, WEIGHTS), spec, read_hf_config(out), "float32")
    got, on_disk = dict(stream), read_hf_weights(hf_dir)
    assert sorted(got) == sorted(on_disk) and all(torch.equal(got[n], on_disk[n]) for n in on_disk)


def first_step(model_path: str, run_dir, *overrides: str) -> dict:
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
                      f"model.path={model_path}", "trainer.steps=1", "trainer.check_logprobs_every=1",
                      "trainer.export_hf=false", "run.progress=false", "trainer.loggers=[jsonl]",
                      f"run.dir={run_dir}", *overrides], timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        (metrics,) = [json.loads(line) for line in f]
    assert metrics["check/logprob_max_diff"] < 1e-3
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "sync/"))}


# the run at TP2 x PP2 (the checkpoint's own layout: no resharding) on request (RLCORE_ALL_LAYOUTS=1), ~220 s of four
# workers; in every run the TP1 run reads it resharded
@pytest.mark.parametrize("layout", [pytest.param([], id="tp1"), pytest.param(TP2XPP2, id="tp2xpp2",
                                                                              marks=ON_REQUEST)])
def test_a_run_from_the_converted_checkpoint_takes_the_hf_runs_first_step(converted, tmp_path, layout):
    hf_dir, out = converted
    assert first_step(out, tmp_path / "converted", *layout) == first_step(hf_dir, tmp_path / "hf", *layout)
