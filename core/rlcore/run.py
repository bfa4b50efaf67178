"""A run's parts and its bookkeeping: the parts built from the registry (checked before any process starts), the run
directory, the starting model, the workers, the rollout source, the learner and the loggers; checkpoints, resume,
the HF export and the summary. The loop itself is ``rlcore.loop``, what runs around its steps ``rlcore.cadence``."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from rlcore import checkpoint
from rlcore.cadence import Cadence
from rlcore.checkpoint import Checkpointer, resolve_resume, run_directory
from rlcore.config import (Config, bind_agent, bind_plugin_section, check_runnable_here, reward_model_world,
                           save_config, to_dict)
from rlcore.errors import RlcoreError
from rlcore.evaluation import evaluate
from rlcore.learner import Learner
from rlcore.lora.base import base_fingerprint
from rlcore.multimodal import ImagePrompts, copy_processor_files
from rlcore.plugins import LoadedPlugins
from rlcore.preflight import (check_context, check_converted_dtype, check_freeze, check_layout, check_optimizers,
                              check_rollout_backend)
from rlcore.rewards import build_rewards, functions_only
from rlcore.rollout.colocated import ColocatedSource
from rlcore.rollout.judge import GenerativeJudge
from rlcore.rollout.reward_model import load_model_reward
from rlcore.rollout.source import Source
from rlcore.rollout_correction import async_default, check_old_logprobs_source
from rlcore.specs import AgentSpec
from rlcore.supervision import Stopped, StopRequest
from rlcore.warm_start import prepare_model

if TYPE_CHECKING:
    from rlcore.workers.judge import JudgeWorkers
    from rlcore.workers.proxies import ActorGroup, CriticGroup, RewardModelGroup, TrainGroup
    from rlcore.workers.rollout_worker import RolloutWorkers

log = logging.getLogger(__name__)


class Run:
    """Built from the config and the selected plugins; ``train()`` starts the workers and runs the loop. ``stop``:
    where a request to stop after a step comes from (`rlcore run`'s SIGTERM); ``restarts``: those before this
    attempt, for the summary (``rlcore.supervision``)."""

    def __init__(self, cfg: Config, plugins: LoadedPlugins, stop: StopRequest | None = None,
                 restarts: list[dict] | None = None):
        check_runnable_here(cfg)
        self.cfg, self.plugins, self.stop, self.restarts = cfg, plugins, stop, restarts or []
        reg = plugins.registry
        self.spec = reg.get("models", cfg.model.family)
        self.algorithm = reg.get("algorithms", cfg.algorithm["name"])
        corrected = async_default(cfg, self.algorithm.config_cls)
        if corrected:
            log.warning("trainer.mode=async with rollout.max_staleness=%d and actor.old_logprobs=actor: %s "
                        "(truncated importance weights against the engine's logprobs); set algorithm.rollout_is=none "
                        "to train uncorrected", cfg.rollout.max_staleness, corrected)
        self.algo_cfg = bind_plugin_section("algorithm", dict(cfg.algorithm), self.algorithm.config_cls)
        check_old_logprobs_source(cfg.actor.old_logprobs, self.algo_cfg)
        task_spec = reg.get("tasks", cfg.task.name)
        self.task = task_spec.build(dict(cfg.task.options), cfg.run.seed)
        self.model_reward = load_model_reward(cfg, reg)      # reward_model.path: a reward model's reward
        self.rewards = build_rewards(cfg.task, task_spec.default_reward, self.task.data_sources(), reg,
                                     self.model_reward.name if self.model_reward else "")
        for kind, name in (("rollout_backends", cfg.rollout.backend), ("agents", cfg.rollout.agent),
                           ("optimizers", cfg.actor.optim.name)):
            reg.get(kind, name)        # an unknown name is refused here, before anything starts
        self.agent = check_agent(cfg, reg)
        check_optimizers(cfg, reg, self.algorithm.needs_critic(self.algo_cfg))
        self._workers: ActorGroup | None = None
        self.rollout: RolloutWorkers | None = None      # async mode's rollout workers
        self.critic: CriticGroup | None = None
        self.reward_model: RewardModelGroup | JudgeWorkers | None = None
        self.logger_classes = [reg.get("loggers", name) for name in cfg.trainer.loggers]
        self.eval_before: dict[str, float] = {}     # the held-out metrics before step 1, which checkpoints keep
        plugins.hook.rlcore_configure(config=cfg)

    def train(self) -> dict:
        """Set up; evaluate (or resume); ``trainer.steps`` steps with their cadence (``rlcore.loop``); export;
        returns the summary. Raises ``Stopped`` where the run stopped on request, after a step's checkpoint."""
        from rlcore import loop
        from rlcore.report import plot_rewards

        cfg = self.cfg
        self.setup()
        summary: dict[str, Any] = {"run_dir": self.run_dir, "model_path": self.model_path,
                                   "parameters": self.workers.num_parameters(),
                                   "worker_nodes": [c.node for c in self.workers.coords],
                                   **({"rollout_workers": self.rollout.where} if self.rollout else {})}
        done, eval_before = self.restore(self.resume_from) if self.resume_from else (0, {})
        self.source.push_weights(self.learner.weights(), self.learner.version, done)   # the engines start with them
        if not self.resume_from:
            eval_before = evaluate(self.source, self.task, cfg, 0)
        summary["eval_accuracy_before"] = eval_before.get("eval/accuracy", float("nan"))
        self.eval_before = eval_before
        history = checkpoint.logged_history(self.run_dir, done)    # a fresh start drops a dead attempt's lines
        self.cadence.start(done, summary["eval_accuracy_before"], history)
        try:
            loop.train(self.source, self.learner, self.cadence, done, cfg.trainer.steps)
            self.cadence.finish()
        finally:
            self.cadence.close()
        if self.cadence.stopped_after is not None:
            raise Stopped(self.cadence.stopped_after)
        summary["eval_accuracy_after"] = history[-1].get("eval/accuracy", float("nan")) if history \
            else summary["eval_accuracy_before"]
        # each reward component's held-out mean, before and after (a reward model's score beside what it stands for)
        last = history[-1] if history else eval_before
        summary["eval_rewards"] = {key[len("eval/reward/"):-len("/mean")]: [eval_before.get(key, math.nan), value]
                                   for key, value in last.items()
                                   if key.startswith("eval/reward/") and key.endswith("/mean")}
        if self.cadence.saved_in is not None:  # the checkpoint after the last step: no next step's metrics to carry it
            summary["last_save_seconds"] = self.cadence.saved_in
        if cfg.trainer.export_hf:
            summary["export"] = self.export_hf(os.path.join(self.run_dir, "hf"))
            if cfg.actor.lora.rank:     # the adapters too, in PEFT's format, beside the merged model
                summary["adapter"] = self.export_adapter(os.path.join(self.run_dir, "adapter"))
        summary["plot"] = plot_rewards(history, eval_before, self.run_dir)
        summary["restarts"] = self.restarts
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    # --- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from rlcore.megatron import patches
        from rlcore.megatron.model import check_model_config, read_hf_config
        from rlcore.reward_training import prepare_reward_model
        from rlcore.rollout.queued import QueuedSource
        from rlcore.workers.judge import JudgeWorkers
        from rlcore.workers.proxies import ActorGroup, ColocatedGroup, CriticGroup, RewardModelGroup
        from rlcore.workers.rollout_worker import RolloutWorkers

        cfg = self.cfg
        self.run_dir = run_directory(cfg)
        os.makedirs(self.run_dir, exist_ok=True)
        self.resume_from = resolve_resume(self.run_dir, cfg.trainer.resume)   # refused here, before workers start
        with open(os.path.join(self.run_dir, "run.json"), "w") as f:
            json.dump({"config": to_dict(cfg), "plugins": self.plugins.describe(), "shims": patches.describe()}, f,
                      indent=2, default=str)
        save_config(cfg, os.path.join(self.run_dir, "config.yaml"))      # what `rlcore run --resume` reads
        self.checkpointer = Checkpointer(self.run_dir, cfg.trainer.save_every, cfg.trainer.keep_checkpoints,
                                         cfg.trainer.checkpoint_async)
        self.model_path = prepare_model(cfg, self.spec, self.task, functions_only(self.rewards),
                                        check=self._check_model)
        hf_config = read_hf_config(self.model_path)
        # a LoRA checkpoint holds the adapters only; these are the base weights they apply to, checked on resume
        self.lora_base = base_fingerprint(self.model_path) if cfg.actor.lora.rank else None
        try:
            check_model_config(self.spec, hf_config, cfg.actor.dtype)
        except ValueError as e:        # refused here, before any worker starts
            raise RlcoreError(f"model.path {self.model_path}: {e}") from e
        check_converted_dtype(cfg, self.model_path)
        self._check_model(hf_config)
        self.hf_config = hf_config
        if self.resume_from:
            checkpoint.check_compatible(self.resume_from, cfg.model.family, hf_config, self.plugins.describe(),
                                        to_dict(cfg), self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.task.bind_tokenizer(self.tokenizer)
        check_context(cfg, hf_config, self.task)      # the engines' length, before they start
        asynchronous = cfg.trainer.mode == "async"
        colocated = None if asynchronous else ColocatedGroup(cfg, self.plugins.selection, self.model_path)
        self._workers = colocated or ActorGroup(cfg, self.plugins.selection, self.model_path)
        if self.algorithm.needs_critic(self.algo_cfg):
            if self.algorithm.value_loss is None:
                raise RlcoreError(f"algorithm {self.algorithm.name!r} asks for a critic but registers no value_loss")
            self.critic = CriticGroup(cfg, self.plugins.selection, self.model_path,
                                      world=cfg.critic.world_size or cfg.trainer.world_size)
            self.critic.sleep()
        if isinstance(self.model_reward, GenerativeJudge):    # on engines of its own, weights fixed
            self.reward_model = JudgeWorkers(cfg, self.plugins.selection, self.model_reward.path)
            self.model_reward.start(self.reward_model, self.tokenizer)
        elif self.model_reward is not None:
            if not self.model_reward.path:      # trained first from reward_training's pairs (cached)
                trained = prepare_reward_model(cfg, self.plugins)
                assert trained is not None
                self.model_reward.use(trained, self.plugins.registry, cfg.reward_model.dtype)
            self.reward_model = RewardModelGroup(cfg, self.plugins.selection, self.model_reward.path,
                                                 world=reward_model_world(cfg))
            self.reward_model.sleep()
            self.model_reward.start(self.reward_model, self.tokenizer)
        keep_group = lambda rewards: self.algorithm.keep_group(rewards, self.algo_cfg)  # noqa: E731
        shared = (self.task, self.tokenizer, hf_config["max_position_embeddings"], self.rewards, keep_group,
                  self.agent.metrics, self.image_prompts())
        if colocated is None:
            self.rollout = RolloutWorkers(cfg, self.plugins.selection, self.model_path)
            self.source: Source = QueuedSource(cfg, self.rollout, *shared)
        else:
            self.source = ColocatedSource(cfg, colocated, *shared)
        self.learner = Learner(cfg, self.workers, self.critic, self.algorithm, self.algo_cfg)
        self.cadence = Cadence(cfg, self.plugins.hook, self.run_dir, self.checkpointer,
                               evaluate=lambda step: evaluate(self.source, self.task, cfg, step),
                               save=lambda step: self.save_checkpoint(step, self.eval_before),
                               profiled=(self.workers, self.critic), stop=self.stop)
        self.cadence.open_loggers(self.logger_classes)

    def image_prompts(self) -> ImagePrompts | None:
        """How a vision-language model's prompts take their images; None for a text-only model."""
        if self.spec.vision is None:
            return None
        return ImagePrompts(self.model_path, self.spec.vision, self.hf_config, self.tokenizer,
                            self.cfg.rollout.limit_images)

    def _check_model(self, hf_config: dict) -> None:
        """What the model must allow before anything slow starts: the layout (the dry run's check), the parts
        actor.freeze names, the rollout backend serving it (routing replay, adapters, images), and room for a
        response in its context (the longest prompt is checked once the task has rendered them)."""
        check_layout(self.cfg, self.spec, hf_config)
        check_rollout_backend(self.cfg, self.plugins.registry, hf_config)
        check_freeze(self.cfg, self.spec)
        check_context(self.cfg, hf_config)

    @property
    def workers(self) -> ActorGroup:
        """The actor's workers, started by ``setup()``."""
        if self._workers is None:
            raise RlcoreError("the run has no workers: setup() has not run, or close() has stopped them")
        return self._workers

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def trained_groups(self) -> dict[str, TrainGroup]:
        return {"actor": self.workers, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self, step: int, eval_before: dict) -> float:
        """The run's state after ``step`` (``rlcore.checkpoint``); returns the seconds it took."""
        self.workers.train_mode()
        state = {**self.source.state_dict(), "algorithm": self.algorithm.state(self.algo_cfg),
                 "eval_before": eval_before, "learner_version": self.learner.version, "config": to_dict(self.cfg),
                 "plugins": self.plugins.describe(),
                 "model": {"family": self.cfg.model.family, "hf_config": self.hf_config, "path": self.model_path,
                           **({"base": self.lora_base} if self.lora_base is not None else {})}}
        return self.checkpointer.save(step, self.trained_groups(), state, self.tokenizer)

    def restore(self, path: str) -> tuple[int, dict]:
        """Continue from checkpoint ``path``: the models, optimizers and generators, the task's sampler, the
        algorithm's state and the learner's version. Returns the step it was saved after and the evaluation before
        step 1."""
        log.warning("resuming from %s", path)
        self.workers.train_mode()
        state = checkpoint.load(path, self.trained_groups())
        self.task.load_state_dict(state["task"])
        self.algorithm.load_state(self.algo_cfg, state["algorithm"])
        self.learner.version = state.get("learner_version", state["step"])   # saved before it was kept: one a step
        self.source.resumed(state["step"], self.learner.version, state)
        return state["step"], state["eval_before"]

    # --- the end -------------------------------------------------------------------------------------------------
    def last_step(self) -> int:
        """The last step the run has logged (0 before the first)."""
        cadence = vars(self).get("cadence")
        return cadence.history[-1]["step"] if cadence is not None and cadence.history else 0

    def export_hf(self, directory: str) -> str:
        """The trained actor as an HF checkpoint (config, safetensors, tokenizer): loadable by transformers/vLLM."""
        self.workers.export_hf(directory)
        self.tokenizer.save_pretrained(directory)
        if self.spec.vision is not None:
            copy_processor_files(self.model_path, directory)
        self.plugins.hook.rlcore_checkpoint_saved(step=self.cfg.trainer.steps, path=directory)
        return directory

    def export_adapter(self, directory: str) -> str:
        """A LoRA run's adapters as PEFT's adapter directory (adapter_config.json, adapter_model.safetensors,
        tokenizer): ``peft.PeftModel.from_pretrained(<the base model>, directory)``."""
        self.workers.export_adapter(directory, self.model_path)
        self.tokenizer.save_pretrained(directory)
        return directory

    def close(self) -> None:
        source = vars(self).pop("source", None)     # once: close() may be called again
        if source is not None:
            source.close()
        for group in (self.rollout, self.reward_model, self.critic, self._workers):
            if group is not None:
                group.stop()
        self._workers = self.critic = self.rollout = self.reward_model = None


def check_agent(cfg: Config, reg) -> AgentSpec:
    """The run's agent; its ``agent:`` section bound (a bad key or value refused in one line naming it) and the
    names it holds checked (an environment, a parser), before anything starts. The bound section is the run's, with
    its defaults, as run.json and checkpoints record it."""
    agent = reg.get("agents", cfg.rollout.agent)
    agent_cfg = bind_agent(agent, cfg.agent)
    if agent_cfg is not None:
        cfg.agent = dataclasses.asdict(agent_cfg)
    if agent.check is not None:
        agent.check(agent_cfg, reg)
    return agent
