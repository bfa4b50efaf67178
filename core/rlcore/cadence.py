"""What runs around the loop's steps, on their schedule: the lifecycle hooks, a profiler on the listed steps
(``trainer.profile_steps``), held-out evaluation every ``trainer.eval_every`` steps and after the last, the loggers,
a checkpoint every ``trainer.save_every`` steps (written while the next step runs, made visible as it ends), the
progress bar and the metrics' history, and the answer to whether the run stops after a step (SIGTERM:
``rlcore.supervision``). ``rlcore.run`` builds it; the loop (``rlcore.loop``) calls it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from rlcore.checkpoint import Checkpointer
from rlcore.config import Config
from rlcore.data import Batch
from rlcore.profiling import Workers
from rlcore.timing import Timer

if TYPE_CHECKING:
    from rlcore.report import ProgressBar
    from rlcore.supervision import StopRequest


class Cadence:
    def __init__(self, cfg: Config, hooks: Any, run_dir: str, checkpointer: Checkpointer,
                 evaluate: Callable[[int], dict[str, float]], save: Callable[[int], float],
                 profiled: tuple[Workers, Workers | None], stop: StopRequest | None = None):
        """``evaluate(step)``: the held-out metrics after ``step``; ``save(step)``: checkpoint the run after ``step``,
        returning the seconds training stood still for it; ``profiled``: the actor's and the critic's workers;
        ``stop``: where a request to stop comes from (SIGTERM)."""
        self.cfg, self.hooks, self.run_dir, self.checkpointer = cfg, hooks, run_dir, checkpointer
        self.evaluate, self.save, self.profiled, self.stop = evaluate, save, profiled, stop
        self.stopped_after: int | None = None     # the step the run stopped after, on request
        self.loggers: list = []
        self.history: list[dict] = []
        self.saved_in: float | None = None        # seconds the checkpoint after the previous step took
        self.bar: ProgressBar | None = None

    def open_loggers(self, logger_classes: list[type]) -> None:
        """Open the run's loggers; if one fails, those already open are closed (a tracker run left open hangs)."""
        for logger_class in logger_classes:
            logger = logger_class()
            try:
                logger.open(self.run_dir, self.cfg)
            except BaseException:
                self.close()
                raise
            self.loggers.append(logger)

    def start(self, done: int, eval_accuracy: float, history: list[dict]) -> None:
        """The steps continue after ``done`` (0, or the step a resume continues after), whose logged ``history``
        they extend; ``eval_accuracy``: the held-out accuracy before step 1, shown until the next evaluation."""
        from rlcore.report import ProgressBar

        self.history = history
        self.bar = ProgressBar(self.cfg.trainer.steps, eval_accuracy, enabled=self.cfg.run.progress, done=done)

    # --- in a step -----------------------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self.hooks.rlcore_step_begin(step=step)

    def timer(self, step: int) -> Timer:
        """The step's phase timer: on a profiled step, one that also profiles the workers doing each phase."""
        if step not in self.cfg.trainer.profile_steps:
            return Timer()
        from rlcore.profiling import ProfilingTimer, profile_directory

        return ProfilingTimer(profile_directory(self.run_dir, step), *self.profiled)

    def rollout_end(self, step: int, batch: Batch) -> None:
        self.hooks.rlcore_rollout_end(step=step, batch=batch)

    # --- after a step --------------------------------------------------------------------------------------------
    def after(self, step: int, metrics: dict[str, float]) -> None:
        """A checkpoint written during the step becomes visible; evaluation when due; the metrics are logged; then
        the checkpoint when due (after the step's metrics are logged: a resume follows on from them)."""
        trainer = self.cfg.trainer
        self.checkpointer.finish()
        if self.saved_in is not None:
            metrics["time/save"], self.saved_in = self.saved_in, None
        if step == trainer.steps or (trainer.eval_every and step % trainer.eval_every == 0):
            metrics.update(self.evaluate(step))
        self.history.append({"step": step, **metrics})
        for logger in self.loggers:
            logger.log(step, metrics)
        if self.checkpointer.due(step):
            self.saved_in = self.save(step)
        self.hooks.rlcore_step_end(step=step, metrics=metrics)
        if self.bar is not None:
            self.bar.update(metrics)

    def stopping(self, step: int) -> bool:
        """Whether the run stops after ``step``, on request; if so, with ``step``'s checkpoint complete and visible
        (the one trainer.save_every has just started, else one written now)."""
        if self.stop is None or not self.stop.requested:
            return False
        if not self.checkpointer.due(step):
            self.save(step)
        self.checkpointer.finish(blocking=True)
        self.stopped_after = step
        return True

    def finish(self) -> None:
        """After the last step: the checkpoint still being written is complete and visible."""
        self.checkpointer.finish(blocking=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        while self.loggers:
            self.loggers.pop().close()
