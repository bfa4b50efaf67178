"""The quickstart's warm start reaches its target held-out accuracy whatever the seed and the last bit of the
numerics: a fixed number of steps did not (a 1e-7 change once moved it from 0.50 to 0.20 accuracy)."""
import dataclasses
import json

import pytest
import torch

from rlcore.config import load_config
from rlcore.errors import RlcoreError
from rlcore.plugins import load_plugins
from rlcore.rewards import build_rewards
from rlcore.warm_start import WarmStart

from runs import ON_REQUEST


def quickstart_warm_start(directory, seed: int, perturb: float = 0.0, **settings) -> WarmStart:
    """The quickstart preset's tiny model and warm start for ``seed``; ``perturb`` is added to every initial
    weight (the numerics change); the tokenizer and config are written into ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = load_config("quickstart", [f"run.seed={seed}"])
    registry = load_plugins(["qwen3", "grpo", "vllm"]).registry
    task_spec = registry.get("tasks", cfg.task.name)
    task = task_spec.build(dict(cfg.task.options), seed)
    spec = registry.get("models", cfg.model.family)
    vocab = task.write_tokenizer(directory)
    with open(f"{directory}/config.json", "w") as f:
        json.dump(spec.tiny_hf_config(vocab_size=vocab, **dataclasses.asdict(cfg.model.tiny)), f)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb)
    score = build_rewards(cfg.task, task_spec.default_reward, {}, registry)
    return WarmStart(model, AutoTokenizer.from_pretrained(directory), task, score,
                     dataclasses.replace(cfg.warm_start, **settings), cfg.rollout.max_response_len)


# seed 0 is the preset's: every end-to-end test's warm-start cache runs it (a missed target is an error there); here
# two other seeds and the last-bit change that once broke a fixed step count (seed 4 on request, for the suite's time)
CASES = {f"seed{s}": dict(seed=s) for s in (2, 4)} | {"seed0-perturbed-1e-7": dict(seed=0, perturb=1e-7)}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=[ON_REQUEST] if c == "seed4" else []) for c in CASES])
def test_the_quickstart_warm_start_reaches_its_target(tmp_path, case):
    run = quickstart_warm_start(tmp_path, **CASES[case])
    result = run.run()
    target = run.settings.target_accuracy
    assert target >= 0.5 and result["held_out_accuracy"] >= target, result
    assert run.accuracy() == result["held_out_accuracy"]        # measured again on the model it hands over
    assert result["steps"] < run.settings.steps, result         # with steps to spare


def test_a_target_not_reached_is_an_error_naming_the_keys(tmp_path):
    run = quickstart_warm_start(tmp_path, 0, steps=2, eval_every=1)
    with pytest.raises(RlcoreError, match=r"warm_start.steps=2, short of warm_start.target_accuracy="):
        run.run()
