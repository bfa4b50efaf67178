"""Plugins shipped with the core: tasks, rewards, loggers, optimizers. Registered through ``builtin``."""
