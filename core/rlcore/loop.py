"""The RL loop. Each step: the rollout source gives the step's trajectories (grouped per prompt, scored), they
become the training batch, the learner updates on it, and the cadence runs (evaluation, loggers, checkpoint,
hooks). What the parts are and how they are built: ``rlcore.run``."""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from rlcore import checkpoint
from rlcore.evaluation import evaluate
from rlcore.rewards import Scores
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory, to_batch

if TYPE_CHECKING:
    from rlcore.data import Batch
    from rlcore.run import Run


def step(run: "Run", number: int) -> dict[str, float]:
    """One RL step; returns its metrics."""
    timer = Timer()
    if number in run.cfg.trainer.profile_steps:      # a profiler only on the listed steps
        from rlcore.profiling import ProfilingTimer, profile_directory

        timer = ProfilingTimer(profile_directory(run.run_dir, number), run.workers, run.critic)
    metrics: dict[str, float] = {}
    trajectories, sampled = run.source.next_groups(number, run.learner.version, timer, metrics)
    metrics.update(reward_metrics(sampled))
    if not trajectories:   # dynamic sampling found no group with a learning signal: nothing to train on
        metrics["sampling/skipped_update"] = 1.0
    else:
        batch = to_batch(trajectories, run.eos_id)
        run.plugins.hook.rlcore_rollout_end(step=number, batch=batch)
        metrics.update(run.learner.update(batch, number, timer))
        metrics.update(length_metrics(trajectories, batch))
        metrics.update(run.agent.metrics(trajectories) if run.agent.metrics else {})
    run.source.weights_updated(run.learner.version, number, timer, metrics)
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
    return metrics


def train(run: "Run") -> dict:
    """Set up, evaluate, run ``trainer.steps`` steps with their cadence, export; returns the summary."""
    from rlcore.report import ProgressBar, plot_rewards

    cfg = run.cfg
    run.setup()
    summary: dict[str, Any] = {"run_dir": run.run_dir, "model_path": run.model_path,
                               "parameters": run.workers.num_parameters(),
                               "worker_nodes": [c.node for c in run.workers.coords],
                               **({"rollout_workers": run.rollout.where} if run.rollout else {})}
    if run.resume_from:
        done, eval_before = run.restore(run.resume_from)
        history = checkpoint.logged_history(run.run_dir, done)
    else:
        done, eval_before, history = 0, evaluate(run.source, run.task, cfg, 0), []
    summary["eval_accuracy_before"] = eval_before.get("eval/accuracy", float("nan"))
    bar = ProgressBar(cfg.trainer.steps, summary["eval_accuracy_before"], enabled=cfg.run.progress, done=done)
    saved_in = None       # seconds the checkpoint after the previous step took
    try:
        for number in range(done + 1, cfg.trainer.steps + 1):
            run.plugins.hook.rlcore_step_begin(step=number)
            start = time.perf_counter()
            metrics = step(run, number)
            metrics["time/step"] = time.perf_counter() - start
            run.checkpointer.finish()            # a checkpoint written during the step becomes visible
            if saved_in is not None:
                metrics["time/save"], saved_in = saved_in, None
            if number == cfg.trainer.steps or (cfg.trainer.eval_every and number % cfg.trainer.eval_every == 0):
                metrics.update(evaluate(run.source, run.task, cfg, number))
            history.append({"step": number, **metrics})
            for logger in run.loggers:
                logger.log(number, metrics)
            if run.checkpointer.due(number):     # after the step's metrics are logged: a resume follows on
                saved_in = run.save_checkpoint(number, eval_before)
            run.plugins.hook.rlcore_step_end(step=number, metrics=metrics)
            bar.update(metrics)
        run.checkpointer.finish(blocking=True)
    finally:
        bar.close()
        run.close_loggers()
    summary["eval_accuracy_after"] = history[-1].get("eval/accuracy", float("nan")) if history \
        else summary["eval_accuracy_before"]
    if saved_in is not None:      # the checkpoint after the last step: no next step's metrics to carry it
        summary["last_save_seconds"] = saved_in
    if cfg.trainer.export_hf:
        summary["export"] = run.export_hf(os.path.join(run.run_dir, "hf"))
        if cfg.actor.lora.rank:     # the adapters too, in PEFT's format, beside the merged model
            summary["adapter"] = run.export_adapter(os.path.join(run.run_dir, "adapter"))
    summary["plot"] = plot_rewards(history, eval_before, run.run_dir)
    with open(os.path.join(run.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def reward_metrics(scores: Scores) -> dict[str, float]:
    """Over every response sampled in the step (dropped groups included): the policy's actual reward."""
    scored = scores.total[~scores.failed]
    return {**scores.metrics(),
            "reward/mean": float(scored.mean()) if len(scored) else float("nan"),
            "reward/std": float(scored.std()) if len(scored) > 1 else 0.0}


def length_metrics(trajectories: list[Trajectory], batch: "Batch") -> dict[str, float]:
    """Prompt and response lengths of the trained trajectories, and how many hit rollout.max_response_len."""
    return {"prompt/length_mean": sum(t.prompt_len for t in trajectories) / len(trajectories),
            "prompt/length_max": float(max(t.prompt_len for t in trajectories)),
            "response/length_mean": float(batch["response_len"].float().mean()),
            "response/length_max": float(batch["response_len"].max()),
            "response/truncated_frac": sum(t.finish == "length" for t in trajectories) / len(trajectories)}
