"""The rollout–training mismatch in a real run: the actor trains in bfloat16 while vLLM (CPU) computes in float32, so
their logprobs of the same sampled tokens differ. The mismatch metrics show it; the truncated importance weights the
correction applies are the ratios capped at the threshold; and the rollout's logprobs can stand in for the old
policy, which skips the old-logprob forward pass."""
import json
import os
import sys

import pytest

from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# two mini-batches: off-policy, so the old policy's logprobs are needed before the update
COMMON = ["quickstart", "warm_start.steps=0", "actor.dtype=bfloat16", "actor.mini_batches=2", "trainer.steps=2",
          "trainer.prompts_per_step=8", "rollout.n=4", "trainer.eval_every=0", "trainer.export_hf=false",
          "trainer.loggers=[jsonl]", "run.progress=false"]


def run(run_dir, *overrides) -> list[dict]:
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", *COMMON,
                      f"run.dir={run_dir}", *overrides], timeout=600,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mismatch_is_measured_and_corrected_between_a_bf16_actor_and_an_fp32_engine(tmp_path):
    corrected = run(tmp_path / "corrected", "algorithm.rollout_is=token", "algorithm.rollout_is_threshold=1.0")
    for h in corrected:
        assert h["rollout_corr/abs_diff_max"] > 1e-3 and h["rollout_corr/abs_diff_mean"] > 0
        assert h["rollout_corr/kl_k3"] > 0
        # token ratios rho = pi_trainer / pi_rollout, capped at 1: those above are cut, the others kept, so the
        # mean weight is below both 1 and the mean ratio, which the KL estimates give independently:
        # k3 - k1 = mean(rho - 1 - log rho) + mean(log rho) = mean(rho) - 1
        mean_ratio = h["rollout_corr/kl_k3"] - h["rollout_corr/kl_k1"] + 1
        assert 0 < h["rollout_corr/tis_clip_frac"] < 1
        assert h["rollout_corr/tis_weight_mean"] < min(1.0, mean_ratio)

    uncapped = run(tmp_path / "uncapped", "algorithm.rollout_is=token", "algorithm.rollout_is_threshold=1e9")
    for h in uncapped:    # nothing capped: the weights are the ratios themselves
        assert h["rollout_corr/tis_clip_frac"] == 0
        mean_ratio = h["rollout_corr/kl_k3"] - h["rollout_corr/kl_k1"] + 1
        # (the ratios are within ~1e-3 of 1: the tolerance is far below their mean's distance from 1)
        assert abs(1 - mean_ratio) > 2e-5
        assert h["rollout_corr/tis_weight_mean"] == pytest.approx(mean_ratio, abs=1e-6)

    from_rollout = run(tmp_path / "from_rollout", "actor.old_logprobs=rollout")
    for before, h in zip(corrected, from_rollout):
        assert h["rollout_corr/abs_diff_max"] > 1e-3          # measured against the update's own forward
        assert "rollout_corr/tis_clip_frac" not in h
        assert h["time/logprobs"] < before["time/logprobs"] / 10   # no old-logprob forward pass
