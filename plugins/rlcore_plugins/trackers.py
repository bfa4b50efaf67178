"""Experiment trackers as loggers: TensorBoard, Weights & Biases, MLflow.

Each package is an optional extra (``pip install 'rlcore[wandb]'``), imported only when a run names the logger in
``trainer.loggers``; a missing one is a one-line ``ConfigError``. Every tracker writes under the run directory
unless told otherwise by its own environment variables, and a run directory that is opened again (a resumed run)
goes on in the same tracker run: W&B and MLflow through the run id kept in ``<run dir>/<tracker>_run_id``.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import numbers
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

from rlcore.errors import ConfigError
from rlcore.specs import Logger

log = logging.getLogger(__name__)

# trainer.loggers name -> the module its package provides (the extra of the rlcore distribution has the same name)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def require(logger: str) -> ModuleType:
    """The tracker's package, or the one-line error that says how to install it."""
    module = PACKAGES[logger]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = f"pip install 'rlcore[{logger}]'"
        if e.name == module:
            raise ConfigError(f"trainer.loggers includes {logger!r} but the {module} package is not installed: "
                              f"{hint}") from e
        raise ConfigError(f"trainer.loggers includes {logger!r} but the {module} package does not import ({e}): "
                          f"{hint}") from e


def check_installed(loggers: list[str]) -> None:
    """Refuses a run that names a tracker whose package is missing (called before any worker starts)."""
    for name in loggers:
        if name in PACKAGES:
            require(name)


def config_dict(config: Any) -> dict:
    """The run's config as plain JSON values: the ``Config`` dataclass, a mapping, or ``{}`` for anything else."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        data: Any = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        return {}
    return json.loads(json.dumps(data, default=str))


def scalars(metrics: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The metrics that are numbers, as floats (NaN included: the step had no value)."""
    for key, value in metrics.items():
        if isinstance(value, numbers.Real):
            yield key, float(value)


def read_id(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_id(path: str, run_id: str) -> None:
    with open(path, "w") as f:
        f.write(run_id + "\n")


class TensorBoardLogger(Logger):
    """Scalars in TensorBoard event files under <run dir>/tensorboard (``tensorboard --logdir <run dir>``).

    Opened again (a resumed run), it writes a new event file whose first step purges the points the earlier
    process logged from that step on (a crash after the last checkpoint), so TensorBoard shows one curve."""
    name = "tensorboard"

    def open(self, run_dir: str, config: Any) -> None:
        require(self.name)
        from torch.utils.tensorboard import SummaryWriter

        self.make_writer = SummaryWriter
        self.directory = os.path.join(run_dir, "tensorboard")
        self.resumed = os.path.isdir(self.directory) and any("tfevents" in f for f in os.listdir(self.directory))
        self.writer: Any = None                 # made at the first step, which a resumed run purges from

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            self.writer = self.make_writer(self.directory, purge_step=step if self.resumed else None)
        for key, value in scalars(metrics):
            self.writer.add_scalar(key, value, step)
        self.writer.flush()                     # a step takes seconds: every point is on disk if the run dies

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLogger(Logger):
    """A Weights & Biases run written under <run dir>/wandb: project ``$WANDB_PROJECT`` (default rlcore), named after
    the run directory, with the resolved config. ``WANDB_MODE=offline`` needs no network or account (upload later
    with ``wandb sync``). Its id is kept in <run dir>/wandb_run_id: a resumed run goes on in the same W&B run."""
    name = "wandb"

    def open(self, run_dir: str, config: Any) -> None:
        wandb = require(self.name)
        id_file = os.path.join(run_dir, "wandb_run_id")
        run_id = read_id(id_file)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "rlcore",
                                  name=os.path.basename(os.path.abspath(run_dir)), dir=run_dir, id=run_id,
                                  resume="allow", config=config_dict(config))
        except wandb.errors.UsageError as e:    # no API key (and not offline): a setup mistake, not a crash
            raise ConfigError(f"trainer.loggers includes 'wandb' but W&B cannot start a run: {e} (set WANDB_API_KEY, "
                              "or WANDB_MODE=offline to write the run locally for a later `wandb sync`)") from e
        if run_id != self.run.id:
            write_id(id_file, self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(scalars(metrics)), step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_FORBIDDEN = re.compile(r"[^/\w.\- ]")


def mlflow_key(name: str) -> str:
    """An rlcore metric or config name as MLflow accepts it, the same every time: MLflow allows letters, digits,
    ``_ - . / space`` (and ``:`` except on Windows), so ``@`` becomes ``_at_`` (``eval/pass@4`` -> ``eval/pass_at_4``)
    and any other character ``_``; empty, ``.`` and ``..`` path segments are dropped (they would alias files)."""
    name = _MLFLOW_FORBIDDEN.sub("_", name.replace("@", "_at_"))
    return "/".join(part for part in name.split("/") if part not in ("", ".", ".."))


def flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Nested config sections as dotted keys (``actor.optim.lr``); lists and empty sections as JSON text."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)


class MlflowLogger(Logger):
    """An MLflow run: tracking URI ``$MLFLOW_TRACKING_URI`` (default: a file store in <run dir>/mlruns), experiment
    ``$MLFLOW_EXPERIMENT_NAME`` (default rlcore), run named after the run directory, the config flattened into params
    and each metric logged at its step under ``mlflow_key(name)``. Its id is kept in <run dir>/mlflow_run_id: a
    resumed run goes on in the same MLflow run (a param whose value changed keeps its first value: MLflow forbids
    changing one). MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE`` is set; this logger sets it (if
    unset) for a local file URI, the store that needs no database packages (mlflow-skinny has none)."""
    name = "mlflow"

    def open(self, run_dir: str, config: Any) -> None:
        require(self.name)
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
        except ImportError:
            MAX_PARAM_VAL_LENGTH = 6000
        uri = os.environ.get("MLFLOW_TRACKING_URI") or Path(run_dir, "mlruns").resolve().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=uri)
        id_file = os.path.join(run_dir, "mlflow_run_id")
        run = None
        if run_id := read_id(id_file):
            try:
                run = client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
            except MlflowException as e:
                log.warning("mlflow: run %s from %s is not in %s (%s); starting a new run", run_id, id_file, uri, e)
                run = None
        if run is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlcore"
            experiment = client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
            run = client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(run_dir)))
            write_id(id_file, run.info.run_id)
        self.run_id = run.info.run_id
        logged = run.data.params
        params = {mlflow_key(k): v[:MAX_PARAM_VAL_LENGTH] for k, v in flatten(config_dict(config))}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("mlflow: run %s keeps the first value of the params changed since: %s", self.run_id,
                        ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):       # MLflow's limit of params per batch
            client.log_batch(self.run_id, params=new[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in scalars(metrics)]
        for i in range(0, len(batch), 1000):    # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
