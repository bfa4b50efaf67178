"""The RL loop (single controller): rollout -> reward -> logprobs -> advantages -> update, plus evaluation."""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager

import torch

from rlcore.config import Config, bind_plugin_section, check_runnable_here, to_dict
from rlcore.data import Batch, build_sequences
from rlcore.engine.logprob_check import fixed_probe, raise_if_disagree
from rlcore.errors import RlcoreError
from rlcore.losses import masked_mean
from rlcore.plugins import LoadedPlugins
from rlcore.rewards import RewardComposer, Scores, neutral_fill
from rlcore.warm_start import prepare_model

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
        task_spec = reg.get("tasks", cfg.task.name)
        self.task = task_spec.build(dict(cfg.task.options), cfg.run.seed)
        weights = dict(cfg.task.rewards) or {cfg.task.reward or task_spec.default_reward: 1.0}
        self.rewards = RewardComposer([(reg.get("rewards", n), w) for n, w in weights.items()],
                                      strict=cfg.task.strict_rewards)
        self.failure_reasons_seen: set[str] = set()
        self.backend_spec = reg.get("rollout_backends", cfg.rollout.backend)
        self.optimizer_spec = reg.get("optimizers", cfg.actor.optim.name)
        self.workers = None
        self.logger_classes = [reg.get("loggers", name) for name in cfg.trainer.loggers]
        # one update per rollout batch: old-policy logprobs need no separate forward pass
        self.on_policy = cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1
        plugins.hook.rlcore_configure(config=cfg)

    # --- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from rlcore.megatron.model import read_hf_config
        from rlcore.workers.group import WorkerGroup

        cfg = self.cfg
        self.run_dir = cfg.run.dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"config": to_dict(cfg), "plugins": self.plugins.describe()}, f, indent=2, default=str)
        self.model_path = prepare_model(cfg, self.spec, self.task, self.optimizer_spec)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_id = self.tokenizer.eos_token_id
        hf_config = read_hf_config(self.model_path)
        arch = (hf_config.get("architectures") or ["?"])[0]
        if arch not in self.spec.hf_architectures:
            raise RlcoreError(f"model.path {self.model_path} holds a {arch} checkpoint but model.family "
                              f"{self.spec.name!r} handles {', '.join(self.spec.hf_architectures)}")
        self.max_len = hf_config["max_position_embeddings"]
        self.workers = WorkerGroup(cfg, self.plugins.selection, self.model_path)
        self.loggers = [c() for c in self.logger_classes]
        for lg in self.loggers:
            lg.open(self.run_dir, cfg)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + self.cfg.rollout.max_response_len > self.max_len:
            raise RlcoreError(f"prompt {text[:40]!r} has {len(ids)} tokens; with rollout.max_response_len "
                              f"{self.cfg.rollout.max_response_len} it exceeds the model's context "
                              f"{self.max_len}. Shorten prompts or lower rollout.max_response_len.")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, texts: list[str], meta: list[dict]) -> Scores:
        scores = self.rewards(texts, meta)
        for reason, count in scores.reasons.items():
            if reason not in self.failure_reasons_seen:   # each reason once; counts go to the metrics
                self.failure_reasons_seen.add(reason)
                log.warning("reward failed for %d sample(s), marked failed and left out of the loss: %s", count,
                            reason)
        return scores

    # --- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Greedy held-out accuracy (mean reward)."""
        self.workers.rollout_mode()
        prompts = self.task.eval_prompts()
        gens = self.workers.generate([self.encode(p) for p, _ in prompts], n=1, temperature=0.0,
                                     max_tokens=self.cfg.rollout.max_response_len)
        scores = self.score([self.decode(g[0].token_ids) for g in gens], [m for _, m in prompts])
        return float(torch.nan_to_num(scores.total, nan=0.0).mean())   # a failed sample counts as wrong

    # --- one RL step ---------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, Timer()
        metrics: dict[str, float] = {}
        prompts = self.task.train_prompts(step, cfg.trainer.prompts_per_step)
        prompt_ids = [self.encode(p) for p, _ in prompts]
        with timer("sync"):
            sync = self.workers.rollout_mode()
        if sync is not None:
            metrics.update({"sync/bytes": float(sync.bytes), "sync/tensors": float(sync.tensors)})
        if cfg.trainer.check_logprobs_every and step % cfg.trainer.check_logprobs_every == 0:
            metrics["check/logprob_max_diff"] = self.check_logprobs(seed=step)
        with timer("rollout"):
            groups = self.workers.generate(prompt_ids, n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                           max_tokens=cfg.rollout.max_response_len)
        flat_prompts, responses, engine_lp, meta, group_ids = [], [], [], [], []
        for i, (ids, group) in enumerate(zip(prompt_ids, groups)):
            for g in group:
                flat_prompts.append(ids)
                responses.append(g.token_ids)
                engine_lp.append(g.logprobs)
                meta.append(prompts[i][1])
                group_ids.append(i)
        with timer("reward"):
            scores = self.score([self.decode(r) for r in responses], meta)
        group_ids = torch.tensor(group_ids)
        rewards = neutral_fill(scores.total, scores.failed, group_ids).float()
        batch = Batch(build_sequences(flat_prompts, responses, self.eos_id, engine_lp), meta)
        batch["response_mask"][scores.failed] = 0          # failed samples train nothing
        batch["rewards"], batch["group_ids"] = rewards, group_ids
        self.plugins.hook.rlcore_rollout_end(step=step, batch=batch)

        self.workers.train_mode()
        mask = batch["response_mask"]
        with timer("logprobs"):
            if not self.on_policy:
                batch["old_logprobs"] = self.workers.logprobs(batch)
            if self.algorithm.needs_reference(self.algo_cfg):
                batch["ref_logprobs"] = self.workers.logprobs(batch, reference=True)
        adv, adv_metrics = self.algorithm.advantages(rewards, batch["group_ids"], mask, self.algo_cfg)
        batch["advantages"] = adv
        with timer("train"):
            train_metrics = self.update(batch)

        scored = scores.total[~scores.failed]
        metrics.update(adv_metrics)
        metrics.update(train_metrics)
        metrics.update(scores.metrics())
        metrics.update({
            "reward/mean": float(scored.mean()) if len(scored) else float("nan"),
            "reward/std": float(scored.std()) if len(scored) > 1 else 0.0,
            "response/length_mean": float(batch["response_len"].float().mean()),
            "response/truncated_frac": sum(g.finish_reason == "length" for grp in groups for g in grp) / len(batch),
            "advantage/mean": float(masked_mean(adv, mask)),
        })
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        return metrics

    def update(self, batch: Batch) -> dict[str, float]:
        """``actor.epochs`` passes of ``actor.mini_batches`` optimizer updates over the rollout batch."""
        size = -(-len(batch) // self.cfg.actor.mini_batches)
        collected: dict[str, list[float]] = {}
        for _ in range(self.cfg.actor.epochs):
            for mini in batch.split(size):
                for k, v in self.workers.train_step(mini, self.on_policy).items():
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
        summary["eval_accuracy_before"] = self.evaluate()
        history = []
        bar = ProgressBar(cfg.trainer.steps, summary["eval_accuracy_before"], enabled=cfg.run.progress)
        try:
            for step in range(1, cfg.trainer.steps + 1):
                self.plugins.hook.rlcore_step_begin(step=step)
                start = time.perf_counter()
                metrics = self.step(step)
                metrics["time/step"] = time.perf_counter() - start
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step != cfg.trainer.steps:
                    metrics["eval/accuracy"] = self.evaluate()
                if step == cfg.trainer.steps:
                    metrics["eval/accuracy"] = summary["eval_accuracy_after"] = self.evaluate()
                history.append({"step": step, **metrics})
                for lg in self.loggers:
                    lg.log(step, metrics)
                self.plugins.hook.rlcore_step_end(step=step, metrics=metrics)
                bar.update(metrics)
        finally:
            bar.close()
            for lg in self.loggers:
                lg.close()
        if cfg.trainer.steps == 0:
            summary["eval_accuracy_after"] = summary["eval_accuracy_before"]
        if cfg.trainer.export_hf:
            summary["export"] = self.export_hf(os.path.join(self.run_dir, "hf"))
        summary["plot"] = plot_rewards(history, summary["eval_accuracy_before"], self.run_dir)
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def export_hf(self, directory: str) -> str:
        """The trained actor as an HF checkpoint (config, safetensors, tokenizer): loadable by transformers/vLLM."""
        self.workers.call("export_hf", directory)
        self.tokenizer.save_pretrained(directory)
        self.plugins.hook.rlcore_checkpoint_saved(step=self.cfg.trainer.steps, path=directory)
        return directory

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
