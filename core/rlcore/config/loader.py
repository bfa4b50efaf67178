"""YAML presets + dot-overrides -> a validated Config. Every mistake becomes one ConfigError naming key and value."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from importlib import resources
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import StringNode

from rlcore.config.schema import Config
from rlcore.converted import MARKER as CONVERTED
from rlcore.errors import ConfigError
from rlcore.lora.config import lora_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
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


_RULES = [  # (key, predicate, what is allowed)
    ("run.seed", lambda v: v >= 0, "an integer >= 0"),
    *[(f"{model}.{key}", ok, allowed) for model in ("actor", "critic", "reward_model") for key, ok, allowed in [
        ("micro_batch_size", lambda v: v >= 1, "an integer >= 1"),
        ("max_tokens_per_micro_batch", lambda v: v >= 0, "an integer >= 0 (0 = micro_batch_size rows each)"),
        ("mini_batches", lambda v: v >= 1, "an integer >= 1"),
        ("epochs", lambda v: v >= 1, "an integer >= 1"),
        ("dtype", lambda v: v in ("float32", "bfloat16"), "float32 or bfloat16"),
        ("recompute", lambda v: v in ("none", "selective", "full"), "none, selective or full"),
        ("optim.lr", lambda v: v > 0, "a number > 0"),
        ("optim.lr_warmup_steps", lambda v: v >= 0, "an integer >= 0"),
        ("optim.lr_schedule", lambda v: v in ("constant", "cosine", "linear"), "constant, cosine or linear"),
        ("optim.min_lr", lambda v: v >= 0, "a number >= 0"),
        ("parallel.tp", lambda v: v >= 1, "an integer >= 1"),
        ("parallel.pp", lambda v: v >= 1, "an integer >= 1"),
        ("parallel.last_stage_layers", lambda v: v >= 0, "an integer >= 0 (0 = split layers evenly)"),
        ("optim.offload_fraction", lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    ]],
    ("actor.entropy_coef", lambda v: v >= 0, "a number >= 0"),
    ("actor.logprob_chunk_tokens", lambda v: v >= 0, "an integer >= 0 (0 = all tokens at once)"),
    ("actor.old_logprobs", lambda v: v in ("auto", "actor", "rollout"), "auto, actor or rollout"),
    ("actor.moe.routing_replay", lambda v: v in ("off", "rollout"), "off or rollout"),
    ("critic.world_size", lambda v: v >= 0, "an integer >= 0 (0 = trainer.world_size)"),
    ("critic.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("reward_model.world_size", lambda v: v >= 0, "an integer >= 0 (0 = the world of the workers it scores for)"),
    ("reward_model.kind", lambda v: v in ("scalar", "generative"), "scalar (a sequence classifier) or generative (a "
                                                                     "causal LM judge, reward_model.judge.*)"),
    ("reward_model.judge.max_tokens", lambda v: v >= 1, "an integer >= 1"),
    ("reward_model.judge.temperature", lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    ("reward_model.judge.kv_cache_gib", lambda v: v >= 0, "a number >= 0 (0 = rollout.kv_cache_gib)"),
    ("rollout.tp", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.devices_per_node", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.sync_bucket_mb", lambda v: v > 0, "a number > 0"),
    ("rollout.sync_transport", lambda v: v in ("auto", "shm", "collectives"), "auto, shm or collectives"),
    ("rollout.lora", lambda v: v in ("merged", "adapters"), "merged or adapters"),
    ("trainer.world_size", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.mode", lambda v: v in ("colocated", "async"), "colocated or async"),
    ("rollout.world_size", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.max_staleness", lambda v: v >= 0, "an integer >= 0"),
    ("rollout.sync_every", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.request_timeout", lambda v: v >= 0, "a number of seconds >= 0 (0 = no limit)"),
    ("trainer.placement", lambda v: v in ("pack", "spread"), "pack or spread"),
    ("rollout.n", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.max_sampling_rounds", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.temperature", lambda v: v > 0, "a number > 0"),
    ("rollout.max_response_len", lambda v: v >= 1, "an integer >= 1"),
    ("rollout.kv_cache_gib", lambda v: v > 0, "a number > 0"),
    ("trainer.steps", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.export_max_shard_gb", lambda v: v > 0, "a number > 0 (GB per safetensors file)"),
    ("trainer.prompts_per_step", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.eval_every", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.check_logprobs_every", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.eval_n", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.save_every", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.max_restarts", lambda v: v >= 0, "an integer >= 0"),
    ("trainer.stop_grace_s", lambda v: v > 0, "a number of seconds > 0"),
    ("trainer.keep_checkpoints", lambda v: v >= 1, "an integer >= 1"),
    ("trainer.eval_temperature", lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    ("trainer.profile_steps", lambda v: all(s >= 1 for s in v), "a list of step numbers >= 1, e.g. [2, 5]"),
    ("warm_start.steps", lambda v: v >= 0, "an integer >= 0"),
    ("reward_training.synthetic_pairs", lambda v: v >= 0, "an integer >= 0"),
    ("reward_training.val_pairs", lambda v: v >= 1, "an integer >= 1"),
    ("reward_training.pairs_per_step", lambda v: v >= 1, "an integer >= 1"),
    ("reward_training.epochs", lambda v: v > 0, "a number > 0"),
    ("reward_training.eval_every", lambda v: v >= 1, "an integer >= 1"),
    ("reward_training.warm_start_accuracy", lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = the policy's start)"),
    ("warm_start.target_accuracy", lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 = no target)"),
    ("warm_start.eval_every", lambda v: v >= 1, "an integer >= 1"),
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
    world = cfg.trainer.world_size
    _check_layout("actor", cfg.actor, world, "trainer.world_size")
    lora_config(cfg.actor.lora)
    if cfg.rollout.lora == "adapters" and not cfg.actor.lora.rank:
        raise ConfigError("rollout.lora = 'adapters' without actor.lora.rank: there are no adapters to send; set "
                          "actor.lora.rank (e.g. 16) to train adapters, or leave rollout.lora=merged")
    _check_layout("critic", cfg.critic, cfg.critic.world_size or world,
                  "critic.world_size" if cfg.critic.world_size else "trainer.world_size")
    if cfg.reward_model.kind == "generative":
        from rlcore.config.judge import check_judge_config

        check_judge_config(cfg)
    elif cfg.reward_model.path:
        rm_world = reward_model_world(cfg)
        _check_layout("reward_model", cfg.reward_model, rm_world, "reward_model.world_size" if
                      cfg.reward_model.world_size else "trainer.world_size" if cfg.trainer.mode == "colocated"
                      else "rollout.world_size")
    # versions are optimizer updates (rlcore.rollout.staleness): a step makes up to mini_batches x epochs of them
    behind = (cfg.rollout.sync_every - 1) * cfg.actor.mini_batches * cfg.actor.epochs
    if cfg.trainer.mode == "async" and cfg.rollout.max_staleness < behind:
        raise ConfigError(f"rollout.sync_every = {cfg.rollout.sync_every} with rollout.max_staleness = "
                          f"{cfg.rollout.max_staleness}: pushing weights every {cfg.rollout.sync_every} steps of up to "
                          f"{cfg.actor.mini_batches * cfg.actor.epochs} optimizer updates each (actor.mini_batches x "
                          f"actor.epochs) trains samples up to {behind} versions behind; set rollout.max_staleness >= "
                          f"{behind}")
    if cfg.trainer.mode == "async" and cfg.rollout.world_size % cfg.rollout.tp:
        raise ConfigError(f"rollout.world_size = {cfg.rollout.world_size} is not a multiple of rollout.tp = "
                          f"{cfg.rollout.tp} (async mode: world_size / tp engine replicas of tp processes each)")
    elif cfg.trainer.mode == "colocated" and world % cfg.rollout.tp:
        raise ConfigError(f"trainer.world_size = {world} is not a multiple of rollout.tp = {cfg.rollout.tp}")
    for key in ("model.path", "critic.model_path", "reward_model.path"):
        given = _get(cfg, key)
        path = os.path.expanduser(given)
        if given and not os.path.isfile(os.path.join(path, "config.json")):
            what = "does not exist" if not os.path.exists(path) else "has no config.json"
            default = {"model.path": "leave model.path empty to build the task's tiny model",
                       "critic.model_path": "leave critic.model_path empty to start the critic from the actor's "
                                            "checkpoint",
                       "reward_model.path": "leave reward_model.path empty to score with reward functions only"}[key]
            raise ConfigError(f"{key} {given!r} {what}: give a Hugging Face checkpoint directory, or {default}")
        if given and not any(f.endswith(".safetensors") or f == CONVERTED for f in os.listdir(path)):
            raise ConfigError(f"{key} {given!r} has no *.safetensors weights (rlcore reads safetensors, or what "
                              f"`rlcore convert` wrote; save the model with transformers' save_pretrained)")
    if cfg.rollout.lora == "adapters" and cfg.model.path and \
            os.path.isfile(os.path.join(os.path.expanduser(cfg.model.path), CONVERTED)):
        raise ConfigError(f"rollout.lora = 'adapters' with model.path {cfg.model.path!r}, a checkpoint `rlcore "
                          f"convert` wrote: the engine cannot start from its files (the actor's weights are pushed "
                          f"to it), so it has no base weights for the adapters; use rollout.lora=merged, or the HF "
                          f"checkpoint it was converted from as model.path")
    if cfg.model.path and not any(os.path.isfile(os.path.join(os.path.expanduser(cfg.model.path), f))
                                  for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path {cfg.model.path!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): save "
                          f"the tokenizer into the checkpoint directory (tokenizer.save_pretrained)")
    if cfg.task.reward and cfg.task.rewards:
        raise ConfigError(f"task.reward = {cfg.task.reward!r} and task.rewards = {dict(cfg.task.rewards)} are both "
                          f"set: give one reward name, or weights for several")
    bad = {k: w for k, w in cfg.task.rewards.items() if not math.isfinite(w)}
    if bad:
        raise ConfigError(f"task.rewards has non-finite weights {bad}: use finite numbers")
    if cfg.trainer.eval_n > 1 and cfg.trainer.eval_temperature == 0:
        raise ConfigError(f"trainer.eval_n = {cfg.trainer.eval_n} with trainer.eval_temperature = 0: greedy "
                          f"responses are all alike; set eval_temperature > 0 (e.g. 1.0) to sample n, or eval_n=1")
    late = [s for s in cfg.trainer.profile_steps if s > cfg.trainer.steps]
    if late:
        raise ConfigError(f"trainer.profile_steps {list(cfg.trainer.profile_steps)} has step(s) {late} after the "
                          f"last step, trainer.steps = {cfg.trainer.steps}: list steps from 1 to {cfg.trainer.steps}")
    if "name" not in cfg.algorithm:
        raise ConfigError("config section 'algorithm' needs a 'name' (e.g. algorithm.name=grpo)")


def reward_model_world(cfg: Config) -> int:
    """The reward model's worker processes: its own count, else as many as the workers whose episodes it scores
    (the trainer's in colocated mode, the rollout workers' in async mode)."""
    if cfg.reward_model.world_size:
        return cfg.reward_model.world_size
    return cfg.trainer.world_size if cfg.trainer.mode == "colocated" else cfg.rollout.world_size


def _check_layout(section: str, model, world: int, world_key: str) -> None:
    """A trained model's parallel sizes against the processes it runs on."""
    p = model.parallel
    if p.cp < 1 or world % (p.tp * p.pp * p.cp):
        raise ConfigError(f"{world_key} = {world} is not a multiple of {section}.parallel.tp x pp x cp = "
                          f"{p.tp} x {p.pp} x {p.cp}; the data-parallel size is world_size / (tp x pp x cp)")
    if p.ep < 1 or (world // p.pp) % p.ep:   # experts fold over the TP x CP x DP ranks of a pipeline stage
        raise ConfigError(f"{section}.parallel.ep = {p.ep} must divide {world_key} / pp = {world // p.pp}")
    if p.sp and p.tp == 1:
        raise ConfigError(f"{section}.parallel.sp = true needs {section}.parallel.tp > 1 (it splits sequences over "
                          f"TP ranks)")
    if model.pack_sequences and not model.max_tokens_per_micro_batch:
        raise ConfigError(f"{section}.pack_sequences = true needs {section}.max_tokens_per_micro_batch > 0 (the "
                          f"tokens packed into each micro-batch's row), e.g. 8192")
    if model.pack_sequences and p.cp > 1:
        raise ConfigError(f"{section}.pack_sequences = true with {section}.parallel.cp = {p.cp}: packed sequences "
                          f"are not split over context-parallel ranks yet; use cp=1 or pack_sequences=false")


def check_runnable_here(cfg: Config) -> None:
    """Limits of this machine rather than of the config (a dry run plans for another machine and skips these)."""
    import torch

    if torch.cuda.is_available():
        return
    for section in ("actor", "critic", "reward_model"):
        model = getattr(cfg, section)
        if model.parallel.ep > 1 and model.parallel.tp > 1:
            raise ConfigError(f"{section}.parallel.ep > 1 with {section}.parallel.tp > 1 is not supported on CPU "
                              f"(gloo) yet: use tp=1 here, or run on GPUs")


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
