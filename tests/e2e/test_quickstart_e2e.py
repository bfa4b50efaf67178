"""End to end: the quickstart (real megatron-core actor, real vLLM rollout, GRPO) moves the policy the right way."""
import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_training_raises_held_out_accuracy_and_reward(quickstart):
    s = quickstart.summary
    history = [json.loads(line) for line in open(os.path.join(s["run_dir"], "metrics.jsonl"))]
    assert len(history) == quickstart.cfg.trainer.steps
    # 200 held-out prompts: +0.10 is several standard errors, not noise
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.10, s
    # the training reward (16 prompts per step, sampled at temperature 1) is too noisy for a fixed margin in 50 steps
    # (per-step std ~0.06); its least-squares trend over the run must still point up
    rewards = [h["reward/mean"] for h in history]
    steps = range(len(rewards))
    mean_step, mean_reward = sum(steps) / len(rewards), sum(rewards) / len(rewards)
    slope = sum((t - mean_step) * (r - mean_reward) for t, r in zip(steps, rewards)) / \
        sum((t - mean_step) ** 2 for t in steps)
    assert slope > 0, (slope, rewards)


def test_run_directory_has_metrics_plot_and_provenance(quickstart):
    run_dir = quickstart.summary["run_dir"]
    assert os.path.getsize(os.path.join(run_dir, "reward_curve.png")) > 10_000
    provenance = json.load(open(os.path.join(run_dir, "run.json")))
    assert {p["name"] for p in provenance["plugins"]} == {"builtin", "qwen3", "grpo", "vllm"}
    assert provenance["config"]["rollout"]["n"] == quickstart.cfg.rollout.n
    assert {"name": "cuda_tensor_type_strings", "megatron_core": "0.16.1"} in provenance["shims"]   # a CPU-only one


def test_engine_and_actor_agreed_on_every_rollout(quickstart):
    """The engine's sampled-token logprobs vs the actor's recomputation, every step (after each weight push)."""
    history = [json.loads(line) for line in open(os.path.join(quickstart.summary["run_dir"], "metrics.jsonl"))]
    worst = max(h["rollout/logprob_diff_vs_actor"] for h in history)
    assert worst < 1e-4, worst
    assert all(h["sync/bytes"] > 0 for h in history[1:])


def test_exported_checkpoint_loads_in_transformers_and_matches_the_actor(quickstart):
    """The run's HF export (written at its end) gives the same logprobs in transformers as the trained actor in
    Megatron."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlcore.data import Batch, build_sequences

    hf = AutoModelForCausalLM.from_pretrained(quickstart.summary["export"], dtype=torch.float32).eval()
    prompts, responses = [quickstart.source.encode("12+35=")] * 2, [quickstart.source.encode("47"),
                                                                    quickstart.source.encode("48")]
    batch = Batch(build_sequences(prompts, responses, quickstart.eos_id))
    ours = quickstart.workers.workers[0].actor.logprobs(batch)
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.roll(batch["input_ids"], -1, 1).unsqueeze(-1))[..., 0]
    mask = batch["response_mask"].bool()
    assert (ours[mask] - theirs[mask]).abs().max() < 1e-4
