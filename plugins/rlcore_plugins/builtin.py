"""The built-in plugin: always loaded, whatever --plugins selects."""
from rlcore.hookspecs import hookimpl
from rlcore_plugins import loggers, optimizers, rewards
from rlcore_plugins.tasks import arithmetic, dataset


@hookimpl
def rlcore_optimizers():
    return optimizers.SPECS


@hookimpl
def rlcore_tasks():
    return [arithmetic.ADDITION, dataset.DATASET]


@hookimpl
def rlcore_rewards():
    return rewards.SPECS


@hookimpl
def rlcore_loggers():
    return [loggers.ConsoleLogger, loggers.JsonlLogger]
