"""Where the run's starting checkpoint comes from: a given HF directory, or the task's tiny model built locally
and (optionally) warm-started with a short supervised run. Built checkpoints are cached by their settings, so
only the first run pays for them."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time

from rlcore.config.schema import ActorConfig, Config, OptimConfig
from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate, masked_mean
from rlcore.specs import ModelSpec, OptimizerSpec, Task

log = logging.getLogger(__name__)
READY = "rlcore_ready.json"


def _cache_key(cfg: Config) -> str:
    what = dict(family=cfg.model.family, tiny=dataclasses.asdict(cfg.model.tiny), task=cfg.task.name,
                options=dict(cfg.task.options), warm=dataclasses.asdict(cfg.warm_start) | {"cache_dir": None},
                seed=cfg.run.seed, version=1)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def prepare_model(cfg: Config, spec: ModelSpec, task: Task, optimizer: OptimizerSpec) -> str:
    """Return an HF checkpoint directory to start RL from (building and caching it when needed)."""
    if cfg.model.path:
        return os.path.expanduser(cfg.model.path)
    if spec.tiny_hf_config is None:
        raise ValueError(f"model family {spec.name!r} cannot build a tiny model; set model.path")
    cache = os.path.expanduser(cfg.warm_start.cache_dir)
    target = os.path.join(cache, f"{spec.name}-{cfg.task.name}-{_cache_key(cfg)}")
    if os.path.isfile(os.path.join(target, READY)):
        log.info("using cached starting checkpoint %s", target)
        return target
    tmp = f"{target}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    vocab = task.write_tokenizer(tmp)
    hf_config = spec.tiny_hf_config(vocab_size=vocab, **dataclasses.asdict(cfg.model.tiny))
    from rlcore.megatron.actor import MegatronActor

    actor_cfg = ActorConfig(micro_batch_size=cfg.warm_start.batch_size,
                            optim=OptimConfig(lr=cfg.warm_start.lr, weight_decay=0.0,
                                              offload_fraction=cfg.actor.optim.offload_fraction))
    actor = MegatronActor(spec, hf_config, actor_cfg, optimizer, seed=cfg.run.seed)
    start = time.perf_counter()
    from transformers import AutoTokenizer

    log.info("no cached starting checkpoint: building the tiny model and warm-starting it for %d steps (cached in "
             "%s for later runs)", cfg.warm_start.steps, target)
    loss = supervised_warm_start(actor, task, AutoTokenizer.from_pretrained(tmp), cfg.warm_start.steps,
                                 cfg.warm_start.batch_size, progress=cfg.run.progress)
    # in HF's sharded layout (files of 1 MB, with an index), as large published checkpoints come: every run of the
    # tiny model then loads a multi-file checkpoint into the actor, the critic and the rollout engine
    actor.save_hf(tmp, max_shard_bytes=1 << 20)
    with open(os.path.join(tmp, READY), "w") as f:
        json.dump({"warm_start_steps": cfg.warm_start.steps, "final_loss": loss,
                   "seconds": time.perf_counter() - start}, f)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def supervised_warm_start(actor, task: Task, tokenizer, steps: int, batch_size: int, progress: bool = False) -> float:
    """Teacher-forced training on the task's (prompt, completion + EOS) examples; returns the last loss.
    ``progress``: a progress bar with the loss, like the RL loop's."""
    from tqdm import tqdm

    eos = tokenizer.eos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    loss = float("nan")
    bar = tqdm(range(steps), desc="warm start (cached after the first run)", unit="step", disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        examples = task.supervised_examples(step, batch_size)
        batch = Batch(build_sequences([encode(p) for p, _ in examples], [encode(c) + [eos] for _, c in examples],
                                      pad_id=eos))
        tokens = float(batch["response_mask"].sum())

        def nll(logp, mb):
            mask = mb["response_mask"]
            share = aggregate(-logp, mask, "token-mean", tokens, len(batch))
            return share, {"sft/loss": masked_mean(-logp, mask).item()}

        loss = actor.train_step(batch, nll)["sft/loss"]
        bar.set_postfix({"loss": f"{loss:.3f}"}, refresh=False)
    bar.close()
    return loss
