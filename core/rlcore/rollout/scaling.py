"""``rlcore scale <run dir> rollout=<n>``: a request for n rollout workers, left in the run directory, which a running
async job reads at the start of each step (``rlcore.rollout.roster.Roster.resize`` does it). A file, not an endpoint:
it needs no port open on the driver, works from any machine that sees the run directory, and outlives the job, so a
resumed run starts at the size asked last."""
from __future__ import annotations

import json
import os

from rlcore.errors import ConfigError

REQUEST = "scale.json"


def request_scale(run_dir: str, setting: str) -> str:
    """``setting`` (``rollout=<n>``) for the async run in ``run_dir``, written atomically (a job never reads half of
    it); returns its path. A bad run dir or setting is refused in one line."""
    from rlcore.config import load_config

    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise ConfigError(f"rlcore scale {run_dir}: no run there (no config.yaml): give the run.dir of a running "
                          f"`rlcore run`")
    mode = load_config(config, []).trainer.mode
    if mode != "async":
        raise ConfigError(f"rlcore scale {run_dir}: the run has trainer.mode={mode}; only async runs have rollout "
                          f"workers of their own to add or remove")
    key, _, value = setting.partition("=")
    if key != "rollout" or not value.isdigit() or int(value) < 1:
        raise ConfigError(f"rlcore scale: {setting!r} is not a size: give rollout=<n>, n >= 1 rollout workers")
    rollout = int(value)
    path = os.path.join(run_dir, REQUEST)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        json.dump({"rollout": rollout}, f)
    os.replace(partial, path)
    return path


class ScaleRequests:
    """The rollout workers asked for in ``run_dir``: each request once, when the file changes."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, REQUEST)
        self.seen: tuple[int, int] | None = None

    def wanted(self) -> int | None:
        """The size asked for since the last call, if a request came (an unreadable one is ignored: the next write
        replaces it)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        if (stat.st_mtime_ns, stat.st_ino) == self.seen:
            return None
        self.seen = (stat.st_mtime_ns, stat.st_ino)
        try:
            with open(self.path) as f:
                wanted = int(json.load(f)["rollout"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return wanted if wanted >= 1 else None
