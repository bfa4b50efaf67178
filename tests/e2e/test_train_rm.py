"""`rlcore train-rm` as a user runs it: a reward model trained with the Bradley-Terry loss on the quickstart task's
preference pairs, at TP2 (the actor's starting checkpoint as its body); killed with SIGKILL after a checkpoint and
resumed, it logs and exports exactly what the uninterrupted run did; its HF export scores as rlcore scored it
(transformers' AutoModelForSequenceClassification agrees with the logged held-out accuracy)."""
import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from runs import kill_when, logged, run_to_end, without_timings

STEPS, EVERY = 12, 5      # checkpoints after steps 5 and 10


def train_rm(run_dir, warm_start_cache, *extra):
    if extra[:1] == ("--resume",):
        return [sys.executable, "-m", "rlcore.cli", "train-rm", "--plugins=qwen3,grpo,vllm", "--resume", str(run_dir)]
    return [sys.executable, "-m", "rlcore.cli", "train-rm", "--plugins=qwen3,grpo,vllm", "quickstart",
            f"reward_training.synthetic_pairs={STEPS * 16}", "reward_training.val_pairs=64",
            "reward_training.pairs_per_step=16", "reward_training.eval_every=6", "reward_model.micro_batch_size=16",
            "reward_model.optim.lr=0.0005", "reward_model.world_size=2", "reward_model.parallel.tp=2",
            f"trainer.save_every={EVERY}", "run.progress=false", f"run.dir={run_dir}",
            f"warm_start.cache_dir={warm_start_cache}", *extra]


def exported(run_dir) -> dict:
    return {name: t for f in sorted((run_dir / "hf").glob("*.safetensors")) for name, t in load_file(f).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, warm_start_cache):
    run_dir = tmp_path_factory.mktemp("train_rm")
    out = run_to_end(train_rm(run_dir, warm_start_cache))
    assert "held-out pairwise accuracy (64 pairs): before 0.000, after" in out.stdout
    return run_dir


@pytest.mark.slow
@pytest.mark.e2e
def test_the_export_scores_held_out_pairs_as_the_run_did(uninterrupted):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    history = logged(uninterrupted)
    assert len(history) == STEPS and [h["step"] for h in history if "eval/accuracy" in h] == [6, 12]
    assert all(h["data/pairs_too_long"] == 0 and "rm/loss" in h for h in history)
    model = AutoModelForSequenceClassification.from_pretrained(uninterrupted / "hf", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(uninterrupted / "hf")
    config = json.loads((uninterrupted / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins

    task = load_plugins(["grpo"]).registry.get("tasks", "addition").build(
        dict(load_config("quickstart", []).task.options), 0)
    wins = 0
    with torch.no_grad():
        for prompt, chosen, rejected in task.preference_pairs(64, held_out=True):
            score = lambda text: model(torch.tensor([tokenizer.encode(prompt + text) + [tokenizer.eos_token_id]]))\
                .logits[0, 0].item()  # noqa: E731
            wins += score(chosen) > score(rejected)
    assert wins / 64 == pytest.approx(history[-1]["eval/accuracy"])


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_after_a_checkpoint_and_resumed_trains_and_exports_exactly_the_same(tmp_path, warm_start_cache,
                                                                                 uninterrupted):
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    kill_when(train_rm(run_dir, warm_start_cache), lambda: len(logged(run_dir)) >= EVERY + 2 and first.exists())
    run_to_end(train_rm(run_dir, warm_start_cache, "--resume"))
    assert math.isnan(json.loads((run_dir / "summary.json").read_text())["val_accuracy_before"])   # it resumed
    assert without_timings(logged(run_dir)) == without_timings(logged(uninterrupted))
    ours, theirs = exported(run_dir), exported(uninterrupted)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)
