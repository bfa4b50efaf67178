"""YAML presets + dot-overrides -> a validated Config. Every mistake becomes one ConfigError naming key and value."""
from __future__ import annotations

import dataclasses
import difflib
import os
from importlib import resources
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import StringNode

from rlcore.config.checks import check_values
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
    reason = str(getattr(e, "msg", e)).splitlines()[0]     # omegaconf appends full_key / reference_type lines
    if isinstance(e, ValidationError):
        return ConfigError(f"config key {key!r} has an invalid value {getattr(e, 'value', None)!r}: {reason}")
    return ConfigError(f"config key {key!r}: {reason}")


def load_config(source: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Merge the schema's defaults, a YAML file or preset, and ``key=value`` overrides; then check values."""
    schema = OmegaConf.structured(Config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.steps=5)")
    try:
        base, given = _read_yaml(source or DEFAULT_PRESET), OmegaConf.from_dotlist(_words_kept(schema, overrides))
        _no_booleans_for_words(schema, base, source or DEFAULT_PRESET)
        _drop_options_of_another_task(base, given)
        for layer in (base, given):
            _one_value_as_list(schema, layer)
        cfg = OmegaConf.merge(schema, base, given)
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _explain(e, schema) from e
    assert isinstance(obj, Config)
    check_values(obj)
    resolve_old_logprobs(obj)
    return obj


CORRECTION_KEYS = ("rollout_is", "rollout_rs_low", "rollout_rs_high")


def resolve_old_logprobs(cfg: Config) -> None:
    """``actor.old_logprobs=auto``: the engine's logprobs in async mode with ``rollout.max_staleness`` > 0, unless the
    run sets one of the algorithm's correction keys itself; the trainer's otherwise. Why the engine's there: a batch
    gets one update, so the trainer's old policy is the weights being updated and its clip bounds nothing, while
    PPO's ratio against the behaviour policy is clipped as the weights drift away from it over S versions; at S=2
    the first collapsed the quickstart (held-out 0.57 -> 0.40 by step 10) and the second learned +0.17 over three
    seeds in 50 steps, more than colocated (docs/benchmarks.md)."""
    if cfg.actor.old_logprobs == "auto":
        stale = cfg.trainer.mode == "async" and cfg.rollout.max_staleness > 0
        corrected = any(key in cfg.algorithm for key in CORRECTION_KEYS)
        cfg.actor.old_logprobs = "rollout" if stale and not corrected else "actor"


def _drop_options_of_another_task(base: DictConfig, given: DictConfig) -> None:
    """Task options belong to their task: when the command line names another task than the file does, the file's
    ``task.options`` are left behind (``rlcore run my.yaml task.name=dataset task.options.train_files=[...]``)."""
    named = OmegaConf.select(given, "task.name")
    if named is not None and named != OmegaConf.select(base, "task.name") and OmegaConf.select(base, "task.options"):
        base.task.options = {}


YAML11_BOOLEANS = ("y", "yes", "n", "no", "on", "off")    # what YAML 1.1 reads as a boolean besides true/false


def _words_kept(schema: DictConfig, overrides: Sequence[str]) -> list[str]:
    """Overrides as given, but a string key's value that YAML 1.1 reads as a boolean quoted, so that it stays the
    word: ``actor.moe.routing_replay=off`` is 'off' (unquoted it would reach the key as 'False')."""
    out = []
    for item in overrides:
        key, value = item.split("=", 1)
        node: Any = schema
        for part in key.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        quoted = isinstance(node, StringNode) and value.strip().lower() in YAML11_BOOLEANS
        out.append(f"{key}='{value.strip()}'" if quoted else item)
    return out


def _no_booleans_for_words(schema: DictConfig, layer: DictConfig, source: str, prefix: str = "") -> None:
    """A YAML file's unquoted ``off`` (``on``, ``yes``, ``no``) is a boolean to YAML 1.1: for a key the schema types
    as a word it would arrive as 'False'; refused in one line asking for quotes (the command line quotes them
    itself: ``_words_kept``)."""
    for key in map(str, layer.keys()):
        node, value = schema._get_node(key) if key in schema else None, layer._get_node(key)
        if isinstance(node, DictConfig) and isinstance(value, DictConfig):
            _no_booleans_for_words(node, value, source, f"{prefix}{key}.")
        elif isinstance(node, StringNode) and value is not None and isinstance(value._value(), bool):
            name = prefix + key
            raise ConfigError(f"config file {source!r}: {name} = {str(value._value()).lower()}, which YAML made of "
                              f"an unquoted on/off/yes/no, but the key takes a word: quote it, e.g. {name}: 'off'")


def _one_value_as_list(schema: DictConfig, given: DictConfig) -> None:
    """A key the schema types as a list takes one value as a list of that value, as verl takes
    ``data.train_files=<path>`` (omegaconf would refuse it: "AnyNode is not a ListConfig")."""
    for key in given.keys():
        if key not in schema:             # an unknown key: the merge names it
            continue
        expected, node = schema._get_node(key), given._get_node(key)
        if isinstance(expected, DictConfig) and isinstance(node, DictConfig):
            _one_value_as_list(expected, node)
        elif isinstance(expected, ListConfig) and not isinstance(node, (DictConfig, ListConfig)) \
                and not OmegaConf.is_interpolation(given, str(key)) and given[key] is not None:
            given[key] = [given[key]]


def bind_plugin_section(section: str, options: dict, config_cls: type) -> Any:
    """Validate a plugin-owned section (e.g. ``algorithm``) against the plugin's own dataclass."""
    schema = OmegaConf.structured(config_cls)
    try:
        given = OmegaConf.create(options)
        _one_value_as_list(schema, given)
        return OmegaConf.to_object(OmegaConf.merge(schema, given))
    except OmegaConfBaseException as e:
        err = _explain(e, schema)
        raise ConfigError(str(err).replace("config key '", f"config key '{section}.", 1)) from e


def bind_agent(spec, section: dict) -> Any:
    """The ``agent:`` section bound to the run's agent's ``config_cls`` (``AgentSpec``), as ``algorithm:`` is to the
    algorithm's; None for an agent that declares none (its section is left as given)."""
    return None if spec.config_cls is None else bind_plugin_section("agent", dict(section), spec.config_cls)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> Config:
    """A config stored as a plain dict (a checkpoint's), validated against the schema."""
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))
    except OmegaConfBaseException as e:
        raise _explain(e, OmegaConf.structured(Config)) from e
    assert isinstance(obj, Config)
    return obj


def save_config(cfg: Config, path: str) -> None:
    """The resolved config as YAML, loadable by ``load_config(path)`` (a resume starts from it)."""
    OmegaConf.save(OmegaConf.create(to_dict(cfg)), path)


def help_text(registry=None) -> str:
    """Every config key with its default; the ``agent:`` section with the defaults of the agents that declare one
    (``AgentSpec.config_cls``) of ``registry``, by default every installed plugin's."""
    if registry is None:
        from rlcore.plugins import load_plugins

        registry = load_plugins().registry
    schema = OmegaConf.structured(Config)
    agent: dict = {}
    for spec in registry.agents.values():
        defaults = OmegaConf.to_container(OmegaConf.structured(spec.config_cls)) if spec.config_cls else {}
        assert isinstance(defaults, dict)
        for key, default in defaults.items():
            agent.setdefault(key, default)
    schema.agent = agent
    return OmegaConf.to_yaml(schema)
