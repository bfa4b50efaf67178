"""The built-in plugin: always loaded, whatever --plugins selects."""
from rlcore.hookspecs import hookimpl
from rlcore.rollout.agents import SINGLE_TURN
from rlcore_plugins import loggers, optimizers, rewards, trackers
from rlcore_plugins.tasks import arithmetic, dataset, shapes


@hookimpl
def rlcore_optimizers():
    return optimizers.SPECS


@hookimpl
def rlcore_agents():
    return [SINGLE_TURN]


@hookimpl
def rlcore_tasks():
    return [arithmetic.ADDITION, dataset.DATASET, shapes.SHAPES]


@hookimpl
def rlcore_rewards():
    return rewards.SPECS


@hookimpl
def rlcore_loggers():
    return [loggers.ConsoleLogger, loggers.JsonlLogger, trackers.TensorBoardLogger, trackers.WandbLogger,
            trackers.MlflowLogger]


@hookimpl
def rlcore_configure(config):
    # A run opens its loggers only after the workers have started (minutes on a cluster): a tracker whose
    # package is missing is refused here instead, when the Run is built, before any model or worker.
    trackers.check_installed(config.trainer.loggers)
