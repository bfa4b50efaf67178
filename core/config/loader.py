"""YAML presets + dot-overrides -> a validated Config. Every mistake becomes one ConfigError naming key and value."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlcore.config.schema import Config
from rlcore.errors import ConfigError

DEFAULT_PRESET = "quickstart"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("rlcore.presets").iterdir() if p.name.endswith(".yaml"))


def _read_yaml(source: str) -> DictConfig:
    if os.path.isfile(source):
        path = source
    elif source in preset_names():
        path = str(resources.files("rlcore.presets") / f"{source}.yaml")
    else:
        raise ConfigError(f"config file {source!r} does not exist and is not a preset "
                          f"(presets: {', '.join(preset_names())}). Give a YAML path or a preset name.")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections (run, model, actor, ...)")
    return loaded


def _suggest(key: str, node: Any) -> str:
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], [str(k) for k in node.keys()], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _explain(e: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, ConfigKeyError):
        parent = OmegaConf.select(schema, key.rsplit(".", 1)[0]) if "." in key else schema
        return ConfigError(f"unknown config key {key!r}{_suggest(key, parent)}. "
                           f"Run `rlcore run --help-config` to list the keys.")
    if isinstance(e, ValidationError):
        expected = getattr(e, "ref_type", None) or ""
        value = getattr(e, "value", None)
        hint = f"; expected {getattr(expected, '__name__', expected)}" if expected else ""
        return ConfigError(f"config key {key!r} has an invalid value {value!r}{hint}: {e.msg}")
    return ConfigError(f"config key {key!r}: {getattr(e, 'msg', e)}")


def load_config(source: str | None = None, overrides: list[str] = ()) -> Config:
    """Merge the schema's defaults, a YAML file or preset, and ``key=value`` overrides; then check values."""
    schema = OmegaConf.structured(Config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.steps=5)")
    try:
        cfg = OmegaConf.merge(schema, _read_yaml(source or DEFAULT_PRESET), OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _explain(e, schema) from e
    check_values(obj)
    return obj


_RULES = [  # (key, predicate, what is allowed)
    ("run.seed", lambda v: v >= 0, "an integer >= 0"),
    ("actor.micro_batch_size", lambda v: v >= 1, "an integer >= 1"),
    ("actor.mini_batches", lambda v: v >= 1, "an integer >= 1"),
    ("actor.epochs", lambda v: v >= 1, "an integer >= 1"),
    ("actor.dtype", lambda v: v in ("float32", "bfloat16"), "float32 or bfloat16"),
    ("actor.optim.lr", lambda v: v > 0, "a number > 0"),
    ("actor.parallel.tp", lambda v: v >= 1, "an integer >= 1"),
    ("actor.parallel.pp", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.tp", lambda v: v >= 1, "an integer >= 1"),
    ("actor.parallel.last_stage_layers", lambda v: v >= 0, "an integer >= 0 (0 = split layers evenly)"),
    ("actor.optim.offload_fraction", lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    ("trainer.devices_per_node", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.sync_bucket_mb", lambda v: v > 0, "a number > 0"),
    ("rollout.sync_transport", lambda v: v in ("auto", "shm", "collectives"), "auto, shm or collectives"),
    ("trainer.world_size", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.placement", lambda v: v in ("pack", "spread"), "pack or spread"),
    ("rollout.n", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.temperature", lambda v: v > 0, "a number > 0"),
    ("rollout.max_response_len", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.kv_cache_gib", lambda v: v > 0, "a number > 0"),
    ("trainer.steps", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.prompts_per_step", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.eval_every", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.check_logprobs_every", lambda v: v >= 0, "an integer >= 0"),
    ("warm_start.steps", lambda v: v >= 0, "an integer >= 0"),
]


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_values(cfg: Config) -> None:
    for key, ok, allowed in _RULES:
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"config key {key!r} = {value!r} is not allowed: use {allowed}")
    world, tp, pp, cp = cfg.trainer.world_size, cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.cp
    if cp < 1 or world % (tp * pp * cp):
        raise ConfigError(f"trainer.world_size = {world} is not a multiple of actor.parallel.tp x pp x cp = "
                          f"{tp} x {pp} x {cp}; the data-parallel size is world_size / (tp x pp x cp)")
    ep = cfg.actor.parallel.ep
    if ep < 1 or (world // pp) % ep:   # experts fold over the TP x CP x DP ranks of a pipeline stage
        raise ConfigError(f"actor.parallel.ep = {ep} must divide world_size / pp = {world // pp}")
    if cfg.actor.parallel.sp and tp == 1:
        raise ConfigError("actor.parallel.sp = true needs actor.parallel.tp > 1 (it splits sequences over TP ranks)")
    if cfg.actor.optim.offload_fraction > 0 and cfg.actor.dtype != "bfloat16":
        raise ConfigError(f"actor.optim.offload_fraction = {cfg.actor.optim.offload_fraction} needs "
                          f"actor.dtype=bfloat16 (Megatron's hybrid CPU/GPU optimizer keeps fp32 master weights)")
    if world % cfg.rollout.tp:
        raise ConfigError(f"trainer.world_size = {world} is not a multiple of rollout.tp = {cfg.rollout.tp}")
    if cfg.model.path:
        path = os.path.expanduser(cfg.model.path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            what = "does not exist" if not os.path.exists(path) else "has no config.json"
            raise ConfigError(f"model.path {cfg.model.path!r} {what}: give a Hugging Face checkpoint directory, "
                              f"or leave model.path empty to build the task's tiny model")
    if cfg.task.reward and cfg.task.rewards:
        raise ConfigError(f"task.reward = {cfg.task.reward!r} and task.rewards = {dict(cfg.task.rewards)} are both "
                          f"set: give one reward name, or weights for several")
    bad = {k: w for k, w in cfg.task.rewards.items() if not math.isfinite(w)}
    if bad:
        raise ConfigError(f"task.rewards has non-finite weights {bad}: use finite numbers")
    if "name" not in cfg.algorithm:
        raise ConfigError("config section 'algorithm' needs a 'name' (e.g. algorithm.name=grpo)")


def check_runnable_here(cfg: Config) -> None:
    """Limits of this machine rather than of the config (a dry run plans for another machine and skips these)."""
    import torch

    if torch.cuda.is_available():
        return
    p = cfg.actor.parallel
    if p.ep > 1 and p.tp > 1:
        raise ConfigError("actor.parallel.ep > 1 with actor.parallel.tp > 1 is not supported on CPU (gloo) yet: "
                          "use tp=1 here, or run on GPUs")
    if cfg.actor.optim.offload_fraction > 0:
        raise ConfigError(f"actor.optim.offload_fraction = {cfg.actor.optim.offload_fraction} needs GPUs "
                          "(Megatron's hybrid CPU/GPU optimizer); on CPU the optimizer state is in host memory "
                          "already: use 0")


def bind_plugin_section(section: str, options: dict, config_cls: type) -> Any:
    """Validate a plugin-owned section (e.g. ``algorithm``) against the plugin's own dataclass."""
    schema = OmegaConf.structured(config_cls)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, options))
    except OmegaConfBaseException as e:
        err = _explain(e, schema)
        raise ConfigError(str(err).replace("config key '", f"config key '{section}.", 1)) from e


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def help_text() -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(Config))
