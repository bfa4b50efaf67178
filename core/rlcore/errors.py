"""User-facing errors. Each carries one message that names the problem and says what to do; the CLI prints it and
exits non-zero without a traceback."""


class RlcoreError(Exception):
    """Base class of every error the CLI reports as a one-line message."""


class ConfigError(RlcoreError):
    """An invalid configuration key or value."""


class PluginError(RlcoreError):
    """A plugin that is unknown, fails to import, or conflicts with another."""


class WorkerDied(RlcoreError):
    """A worker process died (killed, out of memory): the run stops, naming the worker and what it was doing."""


# A worker's error may be the echo of a peer's death (a collective with it failed) that Ray has not reported yet:
# how long the error waits for such a report before it is taken as the worker's own.
PEER_DEATH_WAIT_S = 5.0
