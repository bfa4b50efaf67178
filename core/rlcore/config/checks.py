"""What a config's values must satisfy, checked when it loads (before any process starts): each key's allowed
values (``RULES``), the parallel layouts against the processes they run on, and the paths and combinations a run
cannot start from; ``check_runnable_here``: this machine's limits, which a dry run (planning for another) skips."""
from __future__ import annotations

import math
import os
from typing import Any

from rlcore.config.schema import Config
from rlcore.converted import MARKER as CONVERTED
from rlcore.errors import ConfigError
from rlcore.lora.config import lora_config
from rlcore.model_parts import PARTS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

RULES = [  # (key, predicate, what is allowed)
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
    ("actor.freeze", lambda v: set(v) <= set(PARTS) and len(set(v)) == len(v),
     f"a list of parts, each once, from {', '.join(PARTS)}"),
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
    for key, ok, allowed in RULES:
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"config key {key!r} = {value!r} is not allowed: use {allowed}")
    world = cfg.trainer.world_size
    check_layout("actor", cfg.actor, world, "trainer.world_size")
    lora_config(cfg.actor.lora)
    if cfg.actor.freeze and cfg.actor.lora.rank:
        raise ConfigError(f"actor.freeze = {cfg.actor.freeze} with actor.lora.rank = {cfg.actor.lora.rank}: LoRA "
                          "already keeps every base weight as loaded and trains its adapters only; leave "
                          "actor.freeze empty, or set actor.lora.rank=0 to train the parts left unfrozen")
    if cfg.rollout.lora == "adapters" and not cfg.actor.lora.rank:
        raise ConfigError("rollout.lora = 'adapters' without actor.lora.rank: there are no adapters to send; set "
                          "actor.lora.rank (e.g. 16) to train adapters, or leave rollout.lora=merged")
    check_layout("critic", cfg.critic, cfg.critic.world_size or world,
                  "critic.world_size" if cfg.critic.world_size else "trainer.world_size")
    if cfg.reward_model.kind == "generative":
        from rlcore.config.judge import check_judge_config

        check_judge_config(cfg)
    elif cfg.reward_model.path:
        rm_world = reward_model_world(cfg)
        check_layout("reward_model", cfg.reward_model, rm_world, "reward_model.world_size" if
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


def check_layout(section: str, model, world: int, world_key: str) -> None:
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
