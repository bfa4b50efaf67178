"""The RL loop (single controller): rollout -> reward -> logprobs -> advantages -> update, plus evaluation."""
from __future__ import annotations

import json
import logging
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcore import checkpoint
from rlcore.checkpoint import Checkpointer, resolve_resume
from rlcore.config import Config, bind_plugin_section, check_runnable_here, save_config, to_dict
from rlcore.data import Batch, build_sequences
from rlcore.engine.logprob_check import fixed_probe, raise_if_disagree
from rlcore.errors import RlcoreError
from rlcore.plugins import LoadedPlugins
from rlcore.preflight import check_optimizers, check_rollout_backend
from rlcore.rewards import Scores, build_rewards, neutral_fill
from rlcore.rollout_correction import check_old_logprobs_source
from rlcore.validation import eval_metrics
from rlcore.warm_start import prepare_model

if TYPE_CHECKING:
    from rlcore.workers.group import WorkerGroup

log = logging.getLogger(__name__)


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class Trainer:
    """Builds every part from the registry and runs ``cfg.trainer.steps`` RL steps."""

    def __init__(self, cfg: Config, plugins: LoadedPlugins):
        check_runnable_here(cfg)
        self.cfg, self.plugins = cfg, plugins
        reg = plugins.registry
        self.spec = reg.get("models", cfg.model.family)
        self.algorithm = reg.get("algorithms", cfg.algorithm["name"])
        self.algo_cfg = bind_plugin_section("algorithm", dict(cfg.algorithm), self.algorithm.config_cls)
        check_old_logprobs_source(cfg.actor.old_logprobs, self.algo_cfg)
        task_spec = reg.get("tasks", cfg.task.name)
        self.task = task_spec.build(dict(cfg.task.options), cfg.run.seed)
        self.rewards = build_rewards(cfg.task, task_spec.default_reward, self.task.data_sources(), reg)
        self.failure_reasons_seen: set[str] = set()
        self.backend_spec = reg.get("rollout_backends", cfg.rollout.backend)
        self.optimizer_spec = reg.get("optimizers", cfg.actor.optim.name)
        check_optimizers(cfg, reg, self.algorithm.needs_critic(self.algo_cfg))
        self._workers: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.logger_classes = [reg.get("loggers", name) for name in cfg.trainer.loggers]
        # one update per rollout batch: old-policy logprobs need no separate forward pass
        self.on_policy = cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1
        plugins.hook.rlcore_configure(config=cfg)

    # --- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from rlcore.megatron import patches
        from rlcore.megatron.model import check_model_config, read_hf_config
        from rlcore.workers.group import WorkerGroup

        cfg = self.cfg
        self.run_dir = cfg.run.dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(self.run_dir, exist_ok=True)
        self.resume_from = resolve_resume(self.run_dir, cfg.trainer.resume)   # refused here, before workers start
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"config": to_dict(cfg), "plugins": self.plugins.describe(), "shims": patches.describe()}, f,
                      indent=2, default=str)
        save_config(cfg, os.path.join(self.run_dir, "config.yaml"))      # what `rlcore run --resume` reads
        self.checkpointer = Checkpointer(self.run_dir, cfg.trainer.save_every, cfg.trainer.keep_checkpoints,
                                         cfg.trainer.checkpoint_async)
        self.model_path = prepare_model(cfg, self.spec, self.task, self.score)
        hf_config = read_hf_config(self.model_path)
        try:
            check_model_config(self.spec, hf_config, cfg.actor.dtype)
        except ValueError as e:        # refused here, before any worker starts
            raise RlcoreError(f"model.path {self.model_path}: {e}") from e
        check_rollout_backend(cfg, self.plugins.registry, hf_config)
        self.hf_config = hf_config
        if self.resume_from:
            checkpoint.check_compatible(self.resume_from, cfg.model.family, hf_config, self.plugins.describe(),
                                        to_dict(cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.task.bind_tokenizer(self.tokenizer)
        self.max_len = hf_config["max_position_embeddings"]
        self._workers = WorkerGroup(cfg, self.plugins.selection, self.model_path)
        if self.algorithm.needs_critic(self.algo_cfg):
            from rlcore.workers.critic import CriticWorker

            if self.algorithm.value_loss is None:
                raise RlcoreError(f"algorithm {self.algorithm.name!r} asks for a critic but registers no value_loss")
            self.critic = WorkerGroup(cfg, self.plugins.selection, self.model_path, CriticWorker,
                                      cfg.critic.world_size or cfg.trainer.world_size)
            self.critic.call("sleep")
        self.loggers = []
        for logger_class in self.logger_classes:
            logger = logger_class()
            try:
                logger.open(self.run_dir, cfg)
            except BaseException:           # the ones already open are closed (a tracker run left open hangs)
                self.close_loggers()
                raise
            self.loggers.append(logger)

    @property
    def workers(self) -> WorkerGroup:
        """The actor's workers, started by ``setup()``."""
        if self._workers is None:
            raise RlcoreError("the trainer has no workers: setup() has not run, or close() has stopped them")
        return self._workers

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) + self.cfg.rollout.max_response_len > self.max_len:
            raise RlcoreError(f"prompt {text[:40]!r} has {len(ids)} tokens; with rollout.max_response_len "
                              f"{self.cfg.rollout.max_response_len} it exceeds the model's context "
                              f"{self.max_len}. Shorten prompts or lower rollout.max_response_len.")
        return ids

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)          # one sequence in, one string out
        return text

    def score(self, texts: list[str], meta: list[dict]) -> Scores:
        scores = self.rewards(texts, meta)
        for reason, count in scores.reasons.items():
            if reason not in self.failure_reasons_seen:   # each reason once; counts go to the metrics
                self.failure_reasons_seen.add(reason)
                log.warning("reward failed for %d sample(s), marked failed and left out of the loss: %s", count,
                            reason)
        return scores

    # --- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out scores after ``step``, ``trainer.eval_n`` responses per prompt (``rlcore.validation``); empty
        when the task has no held-out prompts."""
        prompts, cfg = self.task.eval_prompts(), self.cfg.trainer
        if not prompts:
            return {}
        self.workers.rollout_mode()
        groups = self.workers.generate([self.encode(p) for p, _ in prompts], n=cfg.eval_n,
                                       temperature=cfg.eval_temperature, max_tokens=self.cfg.rollout.max_response_len,
                                       seeds=prompt_seeds(len(prompts), self.cfg.run.seed, "eval", step))
        scores = self.score([self.decode(g.token_ids) for group in groups for g in group],
                            [m for _, m in prompts for _ in range(cfg.eval_n)])
        return eval_metrics(scores.total.view(len(prompts), cfg.eval_n),
                            [m.get("data_source", "") for _, m in prompts])

    # --- one RL step ---------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, Timer()
        metrics: dict[str, float] = {}
        with timer("sync"):
            sync = self.workers.rollout_mode()
        if sync is not None:
            metrics.update({"sync/bytes": float(sync.bytes), "sync/tensors": float(sync.tensors)})
        if cfg.trainer.check_logprobs_every and step % cfg.trainer.check_logprobs_every == 0:
            metrics["check/logprob_max_diff"] = self.check_logprobs(seed=step)
        samples, sampled = self.sample(step, timer, metrics)
        metrics.update(reward_metrics(sampled))
        if not len(samples):   # dynamic sampling found no group with a learning signal: nothing to train on
            metrics["sampling/skipped_update"] = 1.0
            metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
            return metrics
        batch = samples.batch(self.eos_id)
        self.plugins.hook.rlcore_rollout_end(step=step, batch=batch)

        self.workers.train_mode()
        with timer("logprobs"):
            if cfg.actor.old_logprobs == "rollout":     # the engine's own: no forward pass
                batch["old_logprobs"] = batch["rollout_logprobs"]
            elif not self.on_policy or self.algorithm.needs_old_logprobs(self.algo_cfg):
                batch["old_logprobs"] = self.workers.logprobs(batch)
            if self.algorithm.needs_reference(self.algo_cfg):
                batch["ref_logprobs"] = self.workers.logprobs(batch, reference=True)
        if self.critic is not None:
            with timer("values"):
                self.critic.call("wake")
                batch["values"] = self.critic.values(batch)
        adv, adv_metrics = self.algorithm.advantages(batch, self.algo_cfg)
        batch["advantages"] = adv
        mask = batch["response_mask"]
        metrics.update(adv_metrics)
        metrics.update(token_stats("advantage", adv, mask))
        if self.critic is not None:
            if "returns" not in batch:
                raise RlcoreError(f"algorithm {self.algorithm.name!r} trains a critic but its advantages() left no "
                                  f"batch['returns'] (the critic's targets): the plugin must store them")
            metrics.update(token_stats("returns", batch["returns"], mask))
            metrics.update(token_stats("values", batch["values"], mask))
            with timer("critic"):
                metrics.update(self.update(self.critic, cfg.critic, batch))
                self.critic.call("sleep")
        if self.critic is None or step > cfg.critic.warmup_steps:
            with timer("train"):
                metrics.update(self.update(self.workers, cfg.actor, batch, self.on_policy))
        metrics.update({
            "prompt/length_mean": sum(map(len, samples.prompts)) / len(samples),
            "prompt/length_max": float(max(map(len, samples.prompts))),
            "response/length_mean": float(batch["response_len"].float().mean()),
            "response/length_max": float(batch["response_len"].max()),
            "response/truncated_frac": sum(f == "length" for f in samples.finish) / len(samples),
        })
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def sample(self, step: int, timer: Timer, metrics: dict) -> tuple["Samples", Scores]:
        """Generate and score ``prompts_per_step`` prompts' groups. Groups the algorithm does not keep (dynamic
        sampling) are dropped and more prompts sampled in their place, up to ``rollout.max_sampling_rounds`` rounds.
        Returns the kept samples and the scores of everything sampled (for the reward metrics)."""
        cfg, wanted = self.cfg, self.cfg.trainer.prompts_per_step
        kept: list[Samples] = []
        scored: list[Scores] = []
        dropped = rounds = 0
        while rounds < cfg.rollout.max_sampling_rounds and sum(k.groups for k in kept) < wanted:
            prompts = self.task.train_prompts(step, wanted * (rounds + 1))[wanted * rounds:]
            rounds += 1
            part = self.rollout_part([self.encode(p) for p, _ in prompts], [m for _, m in prompts], timer,
                                     prompt_seeds(len(prompts), cfg.run.seed, "train", step, rounds))
            scored.append(part.scores)
            keep = [g for g in range(part.groups)
                    if self.algorithm.keep_group(part.rewards[part.group_ids == g], self.algo_cfg)]
            dropped += part.groups - len(keep)
            kept.append(part.select_groups(keep))
        samples = Samples.cat(kept).first_groups(wanted)
        metrics.update({"sampling/groups_dropped": float(dropped), "sampling/rounds": float(rounds),
                        "sampling/groups_kept": float(samples.groups)})
        return samples, Scores.cat(scored)

    def rollout_part(self, prompt_ids: list[list[int]], meta: list[dict], timer: Timer,
                     seeds: list[int]) -> "Samples":
        """``rollout.n`` scored responses to each prompt (sampled with its seed)."""
        cfg = self.cfg
        with timer("rollout"):
            groups = self.workers.generate(prompt_ids, n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                           max_tokens=cfg.rollout.max_response_len, seeds=seeds)
        flat = [(ids, g, meta[i], i) for i, (ids, group) in enumerate(zip(prompt_ids, groups)) for g in group]
        responses, flat_meta = [f[1].token_ids for f in flat], [f[2] for f in flat]
        group_ids = torch.tensor([f[3] for f in flat], dtype=torch.long)
        with timer("reward"):
            scores = self.score([self.decode(r) for r in responses], flat_meta)
        return Samples(prompts=[f[0] for f in flat], responses=responses, logprobs=[f[1].logprobs for f in flat],
                       finish=[f[1].finish_reason for f in flat], meta=flat_meta, group_ids=group_ids,
                       scores=scores, rewards=neutral_fill(scores.total, scores.failed, group_ids).float())

    def update(self, group, model_cfg, batch: Batch, *args) -> dict[str, float]:
        """``epochs`` passes of ``mini_batches`` optimizer updates over the rollout batch, for the actor's or the
        critic's workers; returns the mean of each metric."""
        size = -(-len(batch) // model_cfg.mini_batches)
        collected: dict[str, list[float]] = {}
        for _ in range(model_cfg.epochs):
            for mini in batch.split(size):
                for k, v in group.train_step(mini, *args).items():
                    collected.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in collected.items()}

    def check_logprobs(self, seed: int = 0) -> float:
        """The engine-vs-actor check on a fixed batch, on every rank; raises past trainer.logprob_tolerance."""
        self.workers.rollout_mode()
        probe = fixed_probe(len(self.tokenizer), seed=seed)
        results = self.workers.call("compare_logprobs", *probe, self.eos_id)
        worst = max(results, key=lambda r: r.max_abs_diff)
        raise_if_disagree(worst, self.cfg.trainer.logprob_tolerance)
        return worst.max_abs_diff

    # --- the run -------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from rlcore.report import ProgressBar, plot_rewards

        cfg = self.cfg
        self.setup()
        summary = {"run_dir": self.run_dir, "model_path": self.model_path,
                   "parameters": self.workers.call("num_parameters")[0],
                   "worker_nodes": [c.node for c in self.workers.coords]}
        if self.resume_from:
            done, eval_before = self.restore(self.resume_from)
            history = checkpoint.logged_history(self.run_dir, done)
        else:
            done, eval_before, history = 0, self.evaluate(0), []
        summary["eval_accuracy_before"] = eval_before.get("eval/accuracy", float("nan"))
        bar = ProgressBar(cfg.trainer.steps, summary["eval_accuracy_before"], enabled=cfg.run.progress, done=done)
        saved_in = None       # seconds the checkpoint after the previous step took
        try:
            for step in range(done + 1, cfg.trainer.steps + 1):
                self.plugins.hook.rlcore_step_begin(step=step)
                start = time.perf_counter()
                metrics = self.step(step)
                metrics["time/step"] = time.perf_counter() - start
                self.checkpointer.finish()            # a checkpoint written during the step becomes visible
                if saved_in is not None:
                    metrics["time/save"], saved_in = saved_in, None
                if step == cfg.trainer.steps or (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0):
                    metrics.update(self.evaluate(step))
                history.append({"step": step, **metrics})
                for lg in self.loggers:
                    lg.log(step, metrics)
                if self.checkpointer.due(step):       # after the step's metrics are logged: a resume follows on
                    saved_in = self.save_checkpoint(step, eval_before)
                self.plugins.hook.rlcore_step_end(step=step, metrics=metrics)
                bar.update(metrics)
            self.checkpointer.finish(blocking=True)
        finally:
            bar.close()
            self.close_loggers()
        summary["eval_accuracy_after"] = history[-1].get("eval/accuracy", float("nan")) if history \
            else summary["eval_accuracy_before"]
        if saved_in is not None:      # the checkpoint after the last step: no next step's metrics to carry it
            summary["last_save_seconds"] = saved_in
        if cfg.trainer.export_hf:
            summary["export"] = self.export_hf(os.path.join(self.run_dir, "hf"))
        summary["plot"] = plot_rewards(history, eval_before, self.run_dir)
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def trained_groups(self) -> dict[str, "WorkerGroup"]:
        return {"actor": self.workers, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self, step: int, eval_before: dict) -> float:
        """The run's state after ``step`` (``rlcore.checkpoint``); returns the seconds it took."""
        self.workers.train_mode()
        state = {"task": self.task.state_dict(), "algorithm": self.algorithm.state(self.algo_cfg),
                 "eval_before": eval_before, "config": to_dict(self.cfg), "plugins": self.plugins.describe(),
                 "model": {"family": self.cfg.model.family, "hf_config": self.hf_config}}
        return self.checkpointer.save(step, self.trained_groups(), state, self.tokenizer)

    def restore(self, path: str) -> tuple[int, dict]:
        """Continue from checkpoint ``path``: the models, optimizers and generators, the task's sampler and the
        algorithm's state. Returns the step it was saved after and the evaluation before step 1."""
        log.warning("resuming from %s", path)
        self.workers.train_mode()
        state = checkpoint.load(path, self.trained_groups())
        self.task.load_state_dict(state["task"])
        self.algorithm.load_state(self.algo_cfg, state["algorithm"])
        return state["step"], state["eval_before"]

    def export_hf(self, directory: str) -> str:
        """The trained actor as an HF checkpoint (config, safetensors, tokenizer): loadable by transformers/vLLM."""
        self.workers.call("export_hf", directory)
        self.tokenizer.save_pretrained(directory)
        self.plugins.hook.rlcore_checkpoint_saved(step=self.cfg.trainer.steps, path=directory)
        return directory

    def close_loggers(self) -> None:
        while self.loggers:
            self.loggers.pop().close()

    def close(self) -> None:
        for group in (self.critic, self._workers):
            if group is not None:
                group.stop()
        self._workers = self.critic = None


@dataclass
class Samples:
    """A step's generated samples, flat (one row per response), grouped by prompt (``group_ids`` 0..groups-1)."""
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str]
    meta: list[dict]
    group_ids: torch.Tensor
    scores: Scores
    rewards: torch.Tensor       # the scores with failed samples filled neutrally (the training reward)

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def groups(self) -> int:
        return int(self.group_ids.max()) + 1 if len(self) else 0

    def select_groups(self, keep: list[int]) -> "Samples":
        """The samples of the groups ``keep``, renumbered 0..len(keep)-1 in that order."""
        renumber = {g: i for i, g in enumerate(keep)}
        rows = [r for r, g in enumerate(self.group_ids.tolist()) if g in renumber]
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda items: [items[r] for r in rows]  # noqa: E731
        return Samples(pick(self.prompts), pick(self.responses), pick(self.logprobs), pick(self.finish),
                       pick(self.meta), torch.tensor([renumber[g] for g in self.group_ids[index].tolist()],
                                                     dtype=torch.long),
                       self.scores.select(index), self.rewards[index])

    def first_groups(self, count: int) -> "Samples":
        return self.select_groups(list(range(min(count, self.groups))))

    @staticmethod
    def cat(parts: list["Samples"]) -> "Samples":
        offsets, total = [], 0
        for p in parts:
            offsets.append(total)
            total += p.groups
        return Samples([x for p in parts for x in p.prompts], [x for p in parts for x in p.responses],
                       [x for p in parts for x in p.logprobs], [x for p in parts for x in p.finish],
                       [x for p in parts for x in p.meta],
                       torch.cat([p.group_ids + o for p, o in zip(parts, offsets)]),
                       Scores.cat([p.scores for p in parts]), torch.cat([p.rewards for p in parts]))

    def batch(self, pad_id: int) -> Batch:
        batch = Batch(build_sequences(self.prompts, self.responses, pad_id, self.logprobs), self.meta)
        batch["response_mask"][self.scores.failed] = 0          # failed samples train nothing
        batch["rewards"], batch["group_ids"] = self.rewards, self.group_ids
        return batch


def prompt_seeds(count: int, run_seed: int, *where) -> list[int]:
    """One rollout seed for each of ``count`` prompts, fixed by the run's seed and where the prompts are drawn
    (``"train", step, round`` / ``"eval", step``): a resumed run samples exactly what the uninterrupted one did."""
    key = "/".join(map(str, (run_seed, *where)))
    return [random.Random(f"{key}/{i}").getrandbits(31) for i in range(count)]


def reward_metrics(scores: Scores) -> dict[str, float]:
    """Over every response sampled in the step (dropped groups included): the policy's actual reward."""
    scored = scores.total[~scores.failed]
    return {**scores.metrics(),
            "reward/mean": float(scored.mean()) if len(scored) else float("nan"),
            "reward/std": float(scored.std()) if len(scored) > 1 else 0.0}


def token_stats(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of a per-token tensor over the response tokens."""
    picked = values[mask > 0]
    if not len(picked):
        return {}
    return {f"{name}/mean": float(picked.mean()), f"{name}/std": float(picked.std()) if len(picked) > 1 else 0.0,
            f"{name}/min": float(picked.min()), f"{name}/max": float(picked.max())}
