"""What a person watches: the progress bar during the run and the reward-curve PNG after it."""
from __future__ import annotations

import math
import os

from tqdm import tqdm

PHASES = ("rollout", "sync", "logprobs", "train")


class ProgressBar:
    def __init__(self, total: int, eval_accuracy: float, enabled: bool = True, done: int = 0):
        self.bar = tqdm(total=total, initial=done, desc="rl", unit="step", disable=not enabled, dynamic_ncols=True)
        self.eval_accuracy = eval_accuracy   # the latest held-out accuracy, shown until the next evaluation

    def update(self, m: dict[str, float]) -> None:
        self.eval_accuracy = m.get("eval/accuracy", self.eval_accuracy)
        shown = {"reward": f"{m.get('reward/mean', 0):.3f}", "eval_acc": f"{self.eval_accuracy:.3f}"}
        shown.update({p: f"{m.get(f'time/{p}', 0):.2f}s" for p in PHASES})
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def plot_rewards(history: list[dict], eval_before: dict[str, float], run_dir: str) -> str:
    """Training reward per step (and a moving average) with the held-out scores at each evaluation (accuracy, and
    per data source / pass@n where there are such; ``eval_before``: the metrics of the evaluation before step 1);
    where the reward has components (a reward model's score beside the function it stands for), each one's too.
    Values outside [0, 1] (a reward model's score) are drawn against a scale of their own, on the right. Returns the
    PNG path."""
    from rlcore.evaluation import eval_curves

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "reward_curve.png")
    steps = [h["step"] for h in history]
    rewards = [h.get("reward/mean", float("nan")) for h in history]
    window = max(1, len(rewards) // 20)
    evaluations = ([(0, eval_before)] if eval_before else []) + \
        [(h["step"], h) for h in history if "eval/accuracy" in h]
    accuracy = [(step, m["eval/accuracy"]) for step, m in evaluations]
    components = component_curves(history, evaluations)
    fig, ax = plt.subplots(figsize=(7, 4))
    scores = ax.twinx() if not in_unit_range(rewards + [v for _, v in accuracy]) or \
        any(not bounded for _, _, bounded in components.values()) else None
    total = ax if scores is None or in_unit_range(rewards + [v for _, v in accuracy]) else scores
    total.plot(steps, rewards, color="tab:blue", alpha=0.3, label="train reward (mean per step)")
    total.plot(steps, moving_average(rewards, window), color="tab:blue",
               label=f"train reward (moving avg, {window} steps)")
    if accuracy:
        total.plot(*zip(*accuracy), "o-", color="tab:red", label="held-out accuracy (mean@n)")
    for name, points in eval_curves(evaluations).items():
        ax.plot(*zip(*points), "s--", alpha=0.8, label=f"held-out {name}")
    for (name, (train, held_out, bounded)), color in zip(components.items(), COMPONENT_COLORS):
        axis = ax if bounded or scores is None else scores
        axis.plot(steps, moving_average(train, window), "-", lw=1, color=color, label=f"train {name} (moving avg)")
        if held_out:
            axis.plot(*zip(*held_out), "^:", color=color, label=f"held-out {name}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if scores is not None:
        scores.set_ylabel("score (outside 0-1)")
        more = scores.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="best", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


COMPONENT_COLORS = ("tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive") * 4


def in_unit_range(values: list[float]) -> bool:
    return all(0 <= v <= 1 for v in values if not math.isnan(v))


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def component_curves(history: list[dict], evaluations: list[tuple[int, dict]]
                     ) -> dict[str, tuple[list[float], list[tuple[int, float]], bool]]:
    """Where the reward has several components (a reward model's score and the function it stands for, side by
    side): per component, its mean per training step, its held-out means (step, value) and whether every value lies
    in [0, 1] (drawn on the accuracy axis; others on a scale of their own)."""
    keys = sorted({k for h in history for k in h if k.startswith("reward/") and k.endswith("/mean")} - {"reward/mean"})
    if len(keys) < 2:
        return {}
    curves = {}
    for key in keys:
        train = [h.get(key, math.nan) for h in history]
        held_out = [(step, m[f"eval/{key}"]) for step, m in evaluations if f"eval/{key}" in m]
        curves[key[len("reward/"):-len("/mean")]] = (train, held_out, in_unit_range(train + [v for _, v in held_out]))
    return curves
