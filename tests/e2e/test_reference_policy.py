"""The frozen reference policy used by KL terms: equal to the actor when frozen, unchanged by later updates; offloaded
to the host between its passes (actor.offload.reference) without changing a number."""
import json
import os
import sys

import pytest
import torch

from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate

from runs import run_cli

pytestmark = pytest.mark.slow


def test_reference_is_a_frozen_copy(quickstart):
    actor = quickstart.workers.workers[0].actor
    batch = Batch(build_sequences([quickstart.source.encode("3+4=")] * 4, [quickstart.source.encode("7")] * 4,
                                  quickstart.eos_id))
    actor.freeze_reference()
    try:
        before = actor.logprobs(batch)
        assert torch.equal(actor.logprobs(batch, reference=True), before)
        tokens = float(batch["response_mask"].sum())
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", tokens, 4), {}))
        assert not torch.equal(actor.logprobs(batch), before), "the update changed the actor"
        assert torch.equal(actor.logprobs(batch, reference=True), before), "and left the reference alone"
    finally:
        actor.reference = None          # the update itself is undone by the next test's restore (conftest.quickstart)


def test_offloaded_reference_leaves_the_device_between_its_passes(quickstart, monkeypatch):
    """With actor.offload.reference the reference's parameter storage is empty (on CUDA: in pinned host memory)
    except during its own pass, and its logprobs are bit for bit those of a reference kept on the device."""
    actor = quickstart.workers.workers[0].actor
    batch = Batch(build_sequences([quickstart.source.encode("3+4=")] * 4, [quickstart.source.encode("7")] * 4,
                                  quickstart.eos_id))
    assert not actor.cfg.offload.reference_on_host()     # the quickstart offloads nothing
    actor.freeze_reference()
    try:
        kept = actor.logprobs(batch, reference=True)
        monkeypatch.setattr(actor.cfg.offload, "reference", True)
        actor.freeze_reference()
        params = list(actor.reference.parameters())
        during: list[int] = []
        actor.reference.register_forward_pre_hook(
            lambda *_: during.append(sum(p.untyped_storage().nbytes() for p in params)))
        assert all(p.untyped_storage().nbytes() == 0 for p in params), "parked once frozen"
        assert all(host.device.type == "cpu" and host.is_pinned() == torch.cuda.is_available()
                   for _, host in actor._parked_reference)
        assert torch.equal(actor.logprobs(batch, reference=True), kept)
        assert during == [sum(p.numel() * p.element_size() for p in params)], "whole for its pass"
        assert all(p.untyped_storage().nbytes() == 0 for p in params), "and parked again after it"
        assert torch.equal(actor.logprobs(batch, reference=True), kept)
    finally:
        actor.reference = None


# GRPO with a KL term, a few small steps after the quickstart's warm start; the actor offloads its params in rollout
# mode, so the reference follows by default
KL_RUN = ["algorithm.kl_coef=0.1", "actor.offload.params=true", "trainer.steps=3", "trainer.prompts_per_step=8",
          "rollout.n=4", "trainer.eval_every=0", "trainer.export_hf=false", "trainer.loggers=[jsonl]",
          "run.progress=false"]


def kl_run(run_dir, warm_start_cache, *overrides) -> list[dict]:
    """Each step's metrics but timings. In a process of its own: closing a run in this one would tear down the
    process group the session's quickstart still uses."""
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart",
                      *KL_RUN, f"run.dir={run_dir}", f"warm_start.cache_dir={warm_start_cache}", *overrides],
                     timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


@pytest.mark.e2e
def test_offloading_the_reference_changes_no_step_of_a_kl_run(tmp_path, warm_start_cache):
    offloaded = kl_run(tmp_path / "offloaded", warm_start_cache)      # actor.offload.reference unset: as params
    kept = kl_run(tmp_path / "kept", warm_start_cache, "actor.offload.reference=false")
    assert len(kept) == 3 and kept[-1]["actor/kl_ref"] > 0, kept     # the reference is read, and differs
    assert offloaded == kept
