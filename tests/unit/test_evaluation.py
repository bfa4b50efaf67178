"""Held-out metrics: mean@n and pass@n, overall and per data source; failed samples count as wrong."""
import math

import pytest
import torch

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.evaluation import eval_curves, eval_metrics


def test_mean_and_pass_at_n_overall_and_per_source():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0],      # gsm8k: solved once in four
                            [0.0, 0.0, 0.0, 0.0],      # gsm8k: never
                            [1.0, 1.0, math.nan, 1.0]])  # math: a failed sample counts as wrong
    m = eval_metrics(rewards, ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH"])
    assert m["eval/mean@4"] == pytest.approx((0.25 + 0 + 0.75) / 3) == m["eval/accuracy"]
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/openai/gsm8k/mean@4"] == 0.125 and m["eval/openai/gsm8k/pass@4"] == 0.5
    assert m["eval/lighteval/MATH/mean@4"] == 0.75 and m["eval/lighteval/MATH/pass@4"] == 1.0


def test_rows_without_a_source_get_only_overall_metrics():
    assert set(eval_metrics(torch.tensor([[1.0], [0.0]]), ["", ""])) == {"eval/accuracy", "eval/mean@1",
                                                                         "eval/pass@1"}


def test_curves_drawn_besides_accuracy():
    evals = [(0, eval_metrics(torch.tensor([[1.0, 0.0]]), ["a"])),
             (10, eval_metrics(torch.tensor([[1.0, 1.0]]), ["a"]))]
    assert eval_curves(evals) == {"pass@2": [(0, 1.0), (10, 1.0)], "a mean@2": [(0, 0.5), (10, 1.0)],
                                  "a pass@2": [(0, 1.0), (10, 1.0)]}
    greedy = [(0, eval_metrics(torch.tensor([[1.0]]), ["a"]))]
    assert eval_curves(greedy) == {"a mean@1": [(0, 1.0)]}       # pass@1 is mean@1: drawn once


def test_several_greedy_samples_are_refused():
    with pytest.raises(ConfigError, match="trainer.eval_n = 4 with trainer.eval_temperature = 0"):
        load_config(None, ["trainer.eval_n=4"])
    assert load_config(None, ["trainer.eval_n=4", "trainer.eval_temperature=1.0"]).trainer.eval_n == 4


def test_the_reward_curve_draws_every_evaluation_curve(tmp_path):
    import matplotlib.image

    from rlcore.report import plot_rewards

    before = eval_metrics(torch.tensor([[0.0, 1.0]]), ["a"])
    history = [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 5)]
    history[-1].update(eval_metrics(torch.tensor([[1.0, 1.0]]), ["a"]))
    path = plot_rewards(history, before, str(tmp_path))
    assert matplotlib.image.imread(path).shape[:2] == (400, 700)
    assert plot_rewards(history[:2], {}, str(tmp_path)) == path        # no held-out set: the training curve alone


def test_the_reward_curve_draws_a_reward_model_beside_what_it_stands_for(tmp_path):
    from rlcore.report import component_curves, plot_rewards

    history = [{"step": s, "reward/mean": 2.0 * s, "reward/rm/mean": 2.0 * s, "reward/exact_match/mean": 0.1 * s}
               for s in range(1, 5)]
    history[-1].update({"eval/accuracy": 9.0, "eval/reward/rm/mean": 9.0, "eval/reward/exact_match/mean": 0.5})
    evaluations = [(4, history[-1])]
    curves = component_curves(history, evaluations)
    assert curves == {"exact_match": ([0.1, 0.2, 0.30000000000000004, 0.4], [(4, 0.5)], True),
                      "rm": ([2.0, 4.0, 6.0, 8.0], [(4, 9.0)], False)}     # the score on a scale of its own
    assert component_curves([{"step": 1, "reward/mean": 1.0, "reward/exact_match/mean": 1.0}], []) == {}
    assert plot_rewards(history, {}, str(tmp_path)).endswith("reward_curve.png")
