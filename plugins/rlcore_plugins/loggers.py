"""Built-in metric sinks."""
from __future__ import annotations

import json
import math
import os

from rlcore.specs import Logger

CONSOLE_KEYS = ("reward/mean", "eval/accuracy", "actor/pg_loss", "time/step")


class ConsoleLogger(Logger):
    """A line every ``every`` steps with the headline metrics (the progress bar shows the rest)."""
    name = "console"
    every = 10

    def log(self, step, metrics):
        if step % self.every == 0 or "eval/accuracy" in metrics:
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
            print(f"step {step}: {shown}", flush=True)


class JsonlLogger(Logger):
    """One JSON object per step in <run dir>/metrics.jsonl."""
    name = "jsonl"

    def open(self, run_dir, config):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a")

    def log(self, step, metrics):
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()
