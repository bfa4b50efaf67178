"""Run checkpoints: ``<run dir>/checkpoints/step_<N>/`` holds each trained model's sharded state (``actor/``,
``critic/``: megatron-core distributed checkpointing, reshardable on load, plus per-rank generators) and the
controller's state (``rlcore_checkpoint.json``: step, task sampler, algorithm state, the config and plugin set).

A checkpoint is written under ``.partial-step_<N>-<pid>`` and renamed into place once complete, so a run killed
mid-save leaves the previous checkpoint as the newest complete one; only directories named ``step_<N>`` with the
state file count. By default the tensors are written asynchronously: training goes on while forked writers write
them, and the rename happens at the first step boundary after every rank's writes are done (``Checkpointer.finish``).
No checkpoint file holds pickled code: tensors go through torch_dist, everything else is JSON.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
from typing import Mapping, Protocol

from rlcore.errors import ConfigError
from rlcore.lora.base import base_differences



class Checkpointed(Protocol):
    """A trained model's workers as checkpoints call them (``rlcore.workers.proxies.TrainGroup``); each call is
    collective over the group's ranks."""

    def save_checkpoint(self, directory: str, asynchronous: bool) -> None: ...

    def finish_checkpoint(self, blocking: bool) -> bool: ...

    def load_checkpoint(self, directory: str) -> None: ...


STATE = "rlcore_checkpoint.json"
_COMPLETE = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint of the run, oldest first."""
    root = checkpoint_root(run_dir)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = _COMPLETE.match(name)
        if match and os.path.isfile(os.path.join(root, name, STATE)):
            found.append((int(match[1]), os.path.join(root, name)))
    return sorted(found)


def resolve_resume(run_dir: str, resume: str) -> str | None:
    """The checkpoint ``trainer.resume`` names: "" (start fresh: refused if the run already has checkpoints),
    "auto" (the newest complete one, or a fresh start), "latest" (the newest, which must exist) or a path."""
    found = complete_checkpoints(run_dir)
    if resume == "":
        if found:
            raise ConfigError(f"run.dir {run_dir!r} already has checkpoints (newest: step {found[-1][0]}): continue "
                              f"it with `rlcore run --resume {run_dir}` (or trainer.resume=auto), or give another "
                              f"run.dir")
        return None
    if resume == "auto":
        return found[-1][1] if found else None
    if resume == "latest":
        if not found:
            raise ConfigError(f"trainer.resume=latest: run.dir {run_dir!r} has no complete checkpoint (set "
                              f"trainer.save_every to write them)")
        return found[-1][1]
    if not os.path.isfile(os.path.join(resume, STATE)):
        raise ConfigError(f"trainer.resume {resume!r} is not a complete checkpoint (no {STATE}): give a "
                          f"{checkpoint_root('<run dir>')}/step_<N> directory, auto or latest")
    return resume


def how_to_resume(run_dir: str) -> str:
    """What to tell a user whose run stopped: the command that continues it, if it has a checkpoint."""
    found = complete_checkpoints(run_dir)
    if found:
        return f"resume it from its step {found[-1][0]} checkpoint with: rlcore run --resume {run_dir}"
    return f"{run_dir} has no complete checkpoint to resume from (trainer.save_every writes them): run it again"


class Checkpointer:
    """Saves every ``every`` steps, keeping the newest ``keep``; ``asynchronous``: one save at a time is written
    while training goes on, made visible by ``finish``."""

    def __init__(self, run_dir: str, every: int, keep: int, asynchronous: bool = True):
        self.run_dir, self.every, self.keep, self.asynchronous = run_dir, every, keep, asynchronous
        self.pending: tuple[str, str, Mapping[str, Checkpointed]] | None = None   # partial dir, final dir, writers

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, groups: Mapping[str, Checkpointed], state: dict, tokenizer=None) -> float:
        """Start the checkpoint after ``step`` (with the tokenizer, so that `rlcore export` needs nothing else), and
        wait for it unless asynchronous; returns the seconds training stood still for it (including waiting for the
        previous save, if still being written)."""
        start = time.perf_counter()
        self.finish(blocking=True)
        root = checkpoint_root(self.run_dir)
        for stale in glob.glob(os.path.join(root, ".partial-*")):    # left by a run that died mid-save
            shutil.rmtree(stale, ignore_errors=True)
        partial = os.path.join(root, f".partial-step_{step:08d}-{os.getpid()}")
        os.makedirs(partial)
        for name, group in groups.items():
            group.save_checkpoint(os.path.join(partial, name), self.asynchronous)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(partial, "tokenizer"))
        with open(os.path.join(partial, STATE), "w") as f:
            json.dump({"step": step, **state}, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        self.pending = (partial, os.path.join(root, f"step_{step:08d}"), groups)
        self.finish(blocking=not self.asynchronous)
        return time.perf_counter() - start

    def finish(self, blocking: bool = False) -> bool:
        """Make the pending checkpoint visible if every rank of every group has written its part (waiting for them:
        ``blocking``), and drop the oldest beyond ``keep``. Returns whether none is pending. Collective."""
        if self.pending is None:
            return True
        partial, final, groups = self.pending
        done = [group.finish_checkpoint(blocking) for group in groups.values()]   # every group polled
        if not all(done):
            return False
        shutil.rmtree(final, ignore_errors=True)     # a step saved before, by a run that then died
        os.rename(partial, final)
        self.pending = None
        for _, old in complete_checkpoints(self.run_dir)[:-self.keep]:
            shutil.rmtree(old)
        return True


def check_compatible(path: str, family: str, hf_config: dict, plugins: list[dict], config: dict,
                     model_path: str) -> None:
    """Refuse, before any worker starts, a checkpoint of another model family, architecture or plugin set, or LoRA
    adapters trained on other base weights than ``model_path``'s, naming the difference and the override that
    resumes anyway (``trainer.resume_strict=false``)."""
    with open(os.path.join(path, STATE)) as f:
        saved = json.load(f)
    if not config["trainer"]["resume_strict"]:
        return
    force = "; resume anyway with trainer.resume_strict=false"
    base = saved["model"].get("base")
    if base is not None:
        differ = base_differences(base, model_path)
        if differ:
            raise ConfigError(f"checkpoint {path} holds LoRA adapters trained on the base weights in "
                              f"{saved['model'].get('path')}; this run's base {model_path} differs in "
                              f"{', '.join(differ[:3])}: set model.path to the base the adapters were trained "
                              f"on{force}")
    if saved["model"]["family"] != family:
        raise ConfigError(f"checkpoint {path} is of model family {saved['model']['family']!r}, this run's is "
                          f"{family!r}{force}")
    hf_config = json.loads(json.dumps(hf_config, default=str))      # as the checkpoint stored it
    differ = sorted(k for k in set(saved["model"]["hf_config"]) | set(hf_config)
                    if saved["model"]["hf_config"].get(k) != hf_config.get(k))
    if differ:
        shown = ", ".join(f"{k} {saved['model']['hf_config'].get(k)!r} -> {hf_config.get(k)!r}" for k in differ[:4])
        raise ConfigError(f"checkpoint {path} is of another architecture than model.path: {shown}{force}")
    names = lambda described: sorted(p["name"] for p in described)  # noqa: E731
    if names(saved["plugins"]) != names(plugins):
        raise ConfigError(f"checkpoint {path} was written with plugins {','.join(names(saved['plugins']))}; this run "
                          f"loads {','.join(names(plugins))} (select them with --plugins){force}")


def load(path: str, groups: Mapping[str, Checkpointed]) -> dict:
    """Load every group's models and optimizers from checkpoint ``path``; returns the controller's state."""
    with open(os.path.join(path, STATE)) as f:
        state = json.load(f)
    for name, group in groups.items():
        if not os.path.isdir(os.path.join(path, name)):
            raise ConfigError(f"checkpoint {path!r} has no {name!r} state (it has: "
                              f"{', '.join(sorted(d for d in os.listdir(path) if d in ('actor', 'critic')))})")
        group.load_checkpoint(os.path.join(path, name))
    return state


def logged_history(run_dir: str, step: int) -> list[dict]:
    """The metrics logged up to ``step``; lines of later steps (logged by a run that died before its next
    checkpoint) are cut from metrics.jsonl, so that the resumed run's lines follow on."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)
    nan = lambda row: {k: float("nan") if v is None else v for k, v in row.items()}  # noqa: E731 (jsonl: null)
    return [nan(json.loads(line)) for line in kept]


def run_directory(cfg) -> str:
    """Where a run writes: run.dir (``~`` expanded, as verl's checkpoint folders are written), else
    runs/<start time>. Fixed once: the config then holds it."""
    started = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    cfg.run.dir = os.path.expanduser(cfg.run.dir) if cfg.run.dir else started
    return cfg.run.dir
