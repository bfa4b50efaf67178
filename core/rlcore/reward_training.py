"""`rlcore train-rm`: a scalar reward model trained with the Bradley-Terry loss on preference pairs
(``reward_training``), on Megatron workers in reward_model.*'s layout, with a run's checkpoints, resume, loggers and
progress, and at the end an HF sequence classifier in <run dir>/hf that reward_model.path can name. It reports the
held-out pairwise accuracy (``eval/accuracy``: the share of held-out pairs scored chosen > rejected).

``rlcore run`` trains one first through ``prepare_reward_model`` when reward_model.path is empty and pairs are given:
once, cached under warm_start.cache_dir by its settings, as the warm start is."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
from typing import Any

from rlcore import checkpoint
from rlcore.cadence import Cadence
from rlcore.checkpoint import Checkpointer, resolve_resume, run_directory
from rlcore.config import Config, check_runnable_here, reward_model_world, save_config, to_dict
from rlcore.datasets.preferences import pair_batch, read_pairs, tokenize_pairs
from rlcore.errors import ConfigError
from rlcore.plugins import LoadedPlugins
from rlcore.warm_start import is_ready, publish     # a cache entry, as the warm start's

log = logging.getLogger(__name__)


class RewardModelTraining:
    """Built from the config and plugins; ``train()`` starts the workers, trains, exports and returns the summary."""

    def __init__(self, cfg: Config, plugins: LoadedPlugins):
        check_runnable_here(cfg)
        check_pairs_layout(cfg)
        self.cfg, self.plugins = cfg, plugins
        section = cfg.reward_training
        registry = plugins.registry
        self.task = registry.get("tasks", cfg.task.name).build(dict(cfg.task.options), cfg.run.seed)
        if section.train_files:
            self.train_pairs = read_pairs(section.train_files, section.prompt_key, section.chosen_key,
                                          section.rejected_key)
            self.val_pairs = read_pairs(section.val_files, section.prompt_key, section.chosen_key,
                                        section.rejected_key) if section.val_files else []
            if not self.val_pairs:      # the last val_pairs of the training pairs, held out
                cut = min(section.val_pairs, len(self.train_pairs) // 2)
                if cut < 1:
                    raise ConfigError(f"reward_training.train_files hold {len(self.train_pairs)} pair(s): too few to "
                                      f"hold some out; give more, or reward_training.val_files")
                self.train_pairs, self.val_pairs = self.train_pairs[:-cut], self.train_pairs[-cut:]
        elif section.synthetic_pairs:
            try:
                self.train_pairs = self.task.preference_pairs(section.synthetic_pairs, held_out=False)
                self.val_pairs = self.task.preference_pairs(section.val_pairs, held_out=True)
            except NotImplementedError as e:
                raise ConfigError(f"reward_training.synthetic_pairs = {section.synthetic_pairs}: {e}") from None
        else:
            raise ConfigError("reward_training has no pairs: give reward_training.train_files (Parquet with prompt, "
                              "chosen, rejected), or reward_training.synthetic_pairs=<count> for a task that "
                              "makes them")
        per_step = section.pairs_per_step
        cfg.trainer.steps = max(1, math.ceil(section.epochs * len(self.train_pairs) / per_step))
        cfg.trainer.eval_every = section.eval_every
        self.logger_classes = [registry.get("loggers", name) for name in cfg.trainer.loggers]

    def train(self, run_dir: str | None = None) -> dict:
        """Train for ``trainer.steps`` steps (from reward_training.epochs) in ``run_dir`` (default: the run's),
        resuming as trainer.resume says; write <run dir>/hf; return the summary."""
        from transformers import AutoTokenizer

        from rlcore.megatron.model import read_hf_config
        from rlcore.workers.proxies import RewardModelTrainerGroup

        cfg = self.cfg
        self.run_dir = run_dir or run_directory(cfg)
        os.makedirs(self.run_dir, exist_ok=True)
        resume_from = resolve_resume(self.run_dir, cfg.trainer.resume)
        save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"config": to_dict(cfg), "plugins": self.plugins.describe()}, f, indent=2, default=str)
        start = starting_model(cfg, self.plugins, self.task)
        self.tokenizer = AutoTokenizer.from_pretrained(start)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        context = read_hf_config(start)["max_position_embeddings"]
        self.train_tokens = tokenize_pairs(self.train_pairs, self.tokenizer, context)
        self.val_tokens = tokenize_pairs(self.val_pairs, self.tokenizer, context)
        if not len(self.train_tokens) or not len(self.val_tokens):
            raise ConfigError(f"no preference pair fits the model's context of {context} tokens "
                              f"({self.train_tokens.too_long + self.val_tokens.too_long} are longer)")
        self.group = RewardModelTrainerGroup(cfg, self.plugins.selection, start, world=reward_model_world(cfg))
        checkpointer = Checkpointer(self.run_dir, cfg.trainer.save_every, cfg.trainer.keep_checkpoints,
                                    cfg.trainer.checkpoint_async)
        cadence = Cadence(cfg, self.plugins.hook, self.run_dir, checkpointer, evaluate=self.evaluate,
                          save=lambda step: checkpointer.save(step, {"reward_model": self.group},
                                                              {"config": to_dict(cfg), "start": start},
                                                              self.tokenizer),
                          profiled=(self.group, None))
        try:
            done = 0
            if resume_from:
                log.warning("resuming from %s", resume_from)
                done = checkpoint.load(resume_from, {"reward_model": self.group})["step"]
            before = self.evaluate(0)["eval/accuracy"] if not done else float("nan")
            cadence.open_loggers(self.logger_classes)
            history = checkpoint.logged_history(self.run_dir, done) if done else []
            cadence.start(done, before, history)
            for step in range(done + 1, cfg.trainer.steps + 1):
                cadence.begin(step)
                metrics = self.group.train_step(pair_batch(self.train_tokens, self.step_pairs(step), self.pad_id))
                metrics["data/pairs_too_long"] = float(self.train_tokens.too_long)
                cadence.after(step, metrics)
            cadence.finish()
        finally:
            cadence.close()
        hf_dir = os.path.join(self.run_dir, "hf")
        self.group.export_hf(hf_dir, self.pad_id)
        self.tokenizer.save_pretrained(hf_dir)
        summary: dict[str, Any] = {"run_dir": self.run_dir, "hf": hf_dir, "start": start,
                                   "steps": cfg.trainer.steps, "train_pairs": len(self.train_tokens),
                                   "val_pairs": len(self.val_tokens),
                                   "pairs_too_long": self.train_tokens.too_long + self.val_tokens.too_long,
                                   "val_accuracy_before": before,
                                   "val_accuracy_after": cadence.history[-1].get("eval/accuracy", float("nan"))
                                   if cadence.history else float("nan")}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def step_pairs(self, step: int) -> list[int]:
        """The training pairs of ``step`` (from 1): each epoch's own shuffle (fixed by run.seed and the epoch), read
        ``pairs_per_step`` at a time, so that a resumed run trains on exactly what the uninterrupted one did."""
        n, per_step = len(self.train_tokens), self.cfg.reward_training.pairs_per_step
        positions = range((step - 1) * per_step, step * per_step)
        orders: dict[int, list[int]] = {}
        picked = []
        for p in positions:
            epoch, i = divmod(p, n)
            if epoch not in orders:
                orders[epoch] = list(range(n))
                random.Random(f"{self.cfg.run.seed}/pairs/{epoch}").shuffle(orders[epoch])
            picked.append(orders[epoch][i])
        return picked

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out pairwise accuracy and mean margin of the reward model after ``step``."""
        scores = self.group.scores(pair_batch(self.val_tokens, list(range(len(self.val_tokens))), self.pad_id))
        margin = scores[0::2] - scores[1::2]
        return {"eval/accuracy": float((margin > 0).double().mean()), "eval/margin": float(margin.mean())}

    def close(self) -> None:
        group = vars(self).pop("group", None)
        if group is not None:
            group.stop()


def check_pairs_layout(cfg: Config) -> None:
    """A pair's two rows stay together in a data-parallel share and a micro-batch: an even micro-batch, as many
    pairs per data-parallel rank, one micro-batch per fixed number of rows (no token budget), no context
    parallelism (a score is read at one position of the whole sequence)."""
    section, p = cfg.reward_model, cfg.reward_model.parallel
    dp = reward_model_world(cfg) // (p.tp * p.pp * p.cp)
    if section.micro_batch_size % 2:
        raise ConfigError(f"reward_model.micro_batch_size = {section.micro_batch_size}: training on pairs needs an "
                          f"even number (a pair's two rows in one micro-batch)")
    if cfg.reward_training.pairs_per_step % dp:
        raise ConfigError(f"reward_training.pairs_per_step = {cfg.reward_training.pairs_per_step} is not a multiple "
                          f"of the reward model's data-parallel size {dp}")
    if section.max_tokens_per_micro_batch or p.cp > 1:
        raise ConfigError("training a reward model needs reward_model.max_tokens_per_micro_batch=0 and "
                          "reward_model.parallel.cp=1 (pairs in fixed-size micro-batches, whole sequences)")


def starting_model(cfg: Config, plugins: LoadedPlugins, task) -> str:
    """What the reward model starts from: reward_training.init_from, else the run's starting policy (model.path, or
    the task's warm-started tiny model; warmed to reward_training.warm_start_accuracy where that is set)."""
    from rlcore.rewards import build_rewards
    from rlcore.warm_start import prepare_model

    section = cfg.reward_training
    if section.init_from:
        return os.path.expanduser(section.init_from)
    if section.warm_start_accuracy and not cfg.model.path:
        cfg = dataclasses.replace(cfg, warm_start=dataclasses.replace(cfg.warm_start,
                                                                      target_accuracy=section.warm_start_accuracy))
    registry = plugins.registry
    task_spec = registry.get("tasks", cfg.task.name)
    rewards = build_rewards(dataclasses.replace(cfg.task, rewards={}, reward=""), task_spec.default_reward,
                            task.data_sources(), registry)
    return prepare_model(cfg, registry.get("models", cfg.model.family), task, rewards)


def prepare_reward_model(cfg: Config, plugins: LoadedPlugins) -> str | None:
    """The reward model a run scores with when reward_model.path is empty but reward_training gives pairs: trained
    once (``RewardModelTraining``) and cached under warm_start.cache_dir by its settings; None without pairs."""
    section = cfg.reward_training
    if cfg.reward_model.path or not (section.train_files or section.synthetic_pairs):
        return None
    key = json.dumps({"training": dataclasses.asdict(section), "model": to_dict(cfg)["model"],
                      "warm_start": dataclasses.asdict(cfg.warm_start) | {"cache_dir": None},
                      "task": to_dict(cfg)["task"], "seed": cfg.run.seed,
                      "reward_model": {k: v for k, v in to_dict(cfg)["reward_model"].items() if k not in ("path",)},
                      "files": [os.path.getmtime(os.path.expanduser(f))
                                for f in section.train_files + section.val_files]},
                     sort_keys=True, default=str)
    cache = os.path.expanduser(cfg.warm_start.cache_dir)
    target = os.path.join(cache, f"reward-model-{cfg.task.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if is_ready(target):
        log.warning("using cached reward model %s", target)
        return target
    work = f"{target}.tmp{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    trained = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, save_every=0, resume="",
                                                                   loggers=["jsonl"], profile_steps=[]),
                                  run=dataclasses.replace(cfg.run, dir=work))
    log.warning("no cached reward model: training one on %s preference pairs (cached in %s for later runs)",
                section.synthetic_pairs or "the files'", target)
    training = RewardModelTraining(trained, plugins)
    try:
        summary = training.train(work)
    finally:
        training.close()
    publish(os.path.join(work, "hf"), target, summary)
    shutil.rmtree(work, ignore_errors=True)
    return target
