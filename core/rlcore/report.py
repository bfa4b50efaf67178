"""What a person watches: the progress bar during the run and the reward-curve PNG after it."""
from __future__ import annotations

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
    returns the PNG path."""
    from rlcore.evaluation import eval_curves

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "reward_curve.png")
    steps = [h["step"] for h in history]
    rewards = [h.get("reward/mean", float("nan")) for h in history]
    window = max(1, len(rewards) // 20)
    smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
              for i in range(len(rewards))]
    evaluations = ([(0, eval_before)] if eval_before else []) + \
        [(h["step"], h) for h in history if "eval/accuracy" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="tab:blue", alpha=0.3, label="train reward (mean per step)")
    ax.plot(steps, smooth, color="tab:blue", label=f"train reward (moving avg, {window} steps)")
    if evaluations:
        ax.plot(*zip(*[(step, m["eval/accuracy"]) for step, m in evaluations]), "o-", color="tab:red",
                label="held-out accuracy (mean@n)")
    for name, points in eval_curves(evaluations).items():
        ax.plot(*zip(*points), "s--", alpha=0.8, label=f"held-out {name}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
