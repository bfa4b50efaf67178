"""Where the run's starting checkpoint comes from: a given HF directory, or the task's tiny model built locally
and (optionally) warm-started with a short supervised run. Built checkpoints are cached by their settings, so
only the first run pays for them.

The warm start trains a plain transformers model in the driver (no Megatron state there). It is made robust
rather than lucky: the tiny model's held-out accuracy jumps within a few dozen steps at a point that moves with
the seed and with the last bit of the numerics (a 1e-7 change once moved a fixed 400-step start from 0.50 to 0.20
accuracy), so with ``warm_start.target_accuracy`` it evaluates every ``eval_every`` steps and stops at the first
evaluation that reaches the target; the learning rate decays (cosine) over ``steps``, the most it may take."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
from typing import Callable

import torch

from rlcore.config.schema import Config, WarmStartConfig
from rlcore.data import Batch, build_sequences
from rlcore.errors import RlcoreError
from rlcore.hf_config import with_transformers_defaults
from rlcore.multimodal import IMAGES, ImageInputs, ImagePrompts
from rlcore.rewards import Scores
from rlcore.specs import ModelSpec, Task
from rlcore.evaluation import eval_metrics

log = logging.getLogger(__name__)
READY = "rlcore_ready.json"
Score = Callable[[list[str], list[dict]], Scores]


def _cache_key(cfg: Config) -> str:
    what = dict(family=cfg.model.family, tiny=dataclasses.asdict(cfg.model.tiny), task=cfg.task.name,
                options=dict(cfg.task.options), warm=dataclasses.asdict(cfg.warm_start) | {"cache_dir": None},
                max_response_len=cfg.rollout.max_response_len, seed=cfg.run.seed, version=2)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def prepare_model(cfg: Config, spec: ModelSpec, task: Task, score: Score,
                  check: Callable[[dict], None] | None = None) -> str:
    """Return an HF checkpoint directory to start RL from (building and caching it when needed). ``score``: the
    run's rewards (texts, metadata) -> Scores, which measure the warm start's held-out accuracy. ``check``: called
    with a model it builds before the warm start (minutes), so that a run it would refuse is refused first."""
    if cfg.model.path:
        return os.path.expanduser(cfg.model.path)
    if spec.tiny_hf_config is None:
        raise RlcoreError(f"model family {spec.name!r} cannot build a tiny model; set model.path")
    cache = os.path.expanduser(cfg.warm_start.cache_dir)
    target = os.path.join(cache, f"{spec.name}-{cfg.task.name}-{_cache_key(cfg)}")
    if is_ready(target):
        log.info("using cached starting checkpoint %s", target)
        return target
    tmp = f"{target}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    vocab = task.write_tokenizer(tmp)
    if spec.vision is not None:         # the family's vision tokens join the task's, and its image processor
        if spec.vision.tiny_files is None:
            raise RlcoreError(f"model family {spec.name!r} cannot build a tiny vision-language model; set model.path")
        vocab = spec.vision.tiny_files(tmp, AutoTokenizer.from_pretrained(tmp))
    hf_config = spec.tiny_hf_config(vocab_size=vocab, **dataclasses.asdict(cfg.model.tiny))
    if check is not None:
        try:
            check(with_transformers_defaults(hf_config))     # complete, as the run reads a checkpoint's
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    auto = transformers.AutoModelForImageTextToText if spec.vision else transformers.AutoModelForCausalLM
    with torch.random.fork_rng():         # the run's seed fixes the initial weights, the driver's RNG is untouched
        torch.manual_seed(cfg.run.seed)
        model = auto.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
    log.info("no cached starting checkpoint: building the tiny model and warm-starting it for up to %d steps "
             "(cached in %s for later runs)", cfg.warm_start.steps, target)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    images = None if spec.vision is None else ImagePrompts(tmp, spec.vision, with_transformers_defaults(hf_config),
                                                           tokenizer, cfg.rollout.limit_images)
    trained = WarmStart(model, tokenizer, task, score, cfg.warm_start, cfg.rollout.max_response_len, images).run(
        progress=cfg.run.progress)
    # in HF's sharded layout (files of 1 MB, with an index), as large published checkpoints come: every run of the
    # tiny model then loads a multi-file checkpoint into the actor, the critic and the rollout engine
    with _quiet_transformers():
        model.save_pretrained(tmp, max_shard_size="1MB")
    publish(tmp, target, {**trained, "seconds": time.perf_counter() - start})
    return target


def is_ready(entry: str) -> bool:
    """Whether a cache entry (a starting checkpoint, a trained reward model) was finished: ``publish`` marked it."""
    return os.path.isfile(os.path.join(entry, READY))


def publish(built: str, target: str, record: dict) -> None:
    """Mark the directory ``built`` finished (``record`` in its READY file) and put it in ``target``'s place: another
    run's half-built entry is never read, and an older entry of the same settings is replaced."""
    with open(os.path.join(built, READY), "w") as f:
        json.dump(record, f, indent=2)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(built, target)


def starting_checkpoint(cfg: Config, registry) -> str:
    """``prepare_model`` outside a run (benchmarks, tests): the config's task and rewards built from ``registry`` as
    a run builds them."""
    from rlcore.rewards import build_rewards

    task_spec = registry.get("tasks", cfg.task.name)
    task = task_spec.build(dict(cfg.task.options), cfg.run.seed)
    return prepare_model(cfg, registry.get("models", cfg.model.family), task,
                         build_rewards(cfg.task, task_spec.default_reward, task.data_sources(), registry))


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bar of transformers' own (its shard writer's) beside the warm start's."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class WarmStart:
    """Teacher-forced training on the task's (prompt, completion + EOS) examples, with AdamW and a cosine decay
    over ``settings.steps``; with a target accuracy, greedy held-out evaluations decide when it stops."""

    def __init__(self, model, tokenizer, task: Task, score: Score, settings: WarmStartConfig,
                 max_response_len: int, images: ImagePrompts | None = None):
        """``images``: a vision-language model's prompts, encoded with their images (None: text only)."""
        self.model, self.tokenizer, self.task, self.score = model, tokenizer, task, score
        self.settings, self.max_response_len, self.images = settings, max_response_len, images
        self.eos = tokenizer.eos_token_id
        self._encoded: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """The text's token ids, each text tokenized once: the examples recur every step, and tokenizing them again
        cost a tenth of the warm start's time."""
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(self._encoded[text])

    def run(self, progress: bool = False) -> dict:
        """Train; returns the steps taken, the last loss and the last held-out accuracy (NaN if never measured).
        Raises when a target accuracy is set and not reached in ``steps``."""
        from tqdm import tqdm

        s = self.settings
        result = {"steps": 0, "final_loss": float("nan"), "held_out_accuracy": float("nan")}
        if not s.steps:                    # no warm start: the model as built
            return result
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr, weight_decay=0.0)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5 * (1 + math.cos(math.pi * k / s.steps)))
        bar = tqdm(range(s.steps), desc="warm start (cached after the first run)", unit="step",
                   disable=not progress, dynamic_ncols=True)
        self.model.train()
        for step in bar:
            loss = self.loss(self.task.supervised_examples(step, s.batch_size))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            optimizer.step()
            decay.step()
            result.update(steps=step + 1, final_loss=loss.item())
            if s.target_accuracy and (step + 1) % s.eval_every == 0:
                result["held_out_accuracy"] = self.accuracy()
                log.info("warm start step %d: loss %.3f, held-out accuracy %.3f", step + 1, loss.item(),
                         result["held_out_accuracy"])
                if result["held_out_accuracy"] >= s.target_accuracy:
                    break
            bar.set_postfix({"loss": f"{result['final_loss']:.3f}", "acc": f"{result['held_out_accuracy']:.2f}"},
                            refresh=False)
        bar.close()
        if s.target_accuracy and not result["held_out_accuracy"] >= s.target_accuracy:
            raise RlcoreError(f"the warm start reached held-out accuracy {result['held_out_accuracy']:.3f} in "
                              f"warm_start.steps={s.steps}, short of warm_start.target_accuracy="
                              f"{s.target_accuracy}: raise warm_start.steps or lower the target")
        return result

    def prompt(self, text: str, metadata: dict) -> tuple[list[int], ImageInputs | None]:
        """A prompt's tokens, and its images' pixels when it holds any."""
        if self.images is None or not metadata.get(IMAGES):
            return self.encode(text), None
        tokens, _, pixels = self.images.encode(text, metadata[IMAGES], f"warm start prompt {text[:40]!r}")
        return tokens, pixels

    def forward(self, tokens: torch.Tensor, images: list[ImageInputs | None]) -> torch.Tensor:
        """The model's logits; rows holding images get them."""
        more = self.images.transformers_inputs(tokens, images) if self.images is not None else {}
        return self.model(input_ids=tokens, **more).logits

    def loss(self, examples: list[tuple[str, str]] | list[tuple[str, str, dict]]) -> torch.Tensor:
        """Mean negative log-likelihood of the completions' tokens (EOS included) given their prompts."""
        prompts = [self.prompt(e[0], e[2] if len(e) > 2 else {}) for e in examples]
        batch = Batch(build_sequences([tokens for tokens, _ in prompts],
                                      [self.encode(e[1]) + [self.eos] for e in examples], pad_id=self.eos))
        tokens = batch["input_ids"]                 # right-padded: causal attention never sees the padding
        logits = self.forward(tokens, [pixels for _, pixels in prompts])[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        mask = batch["response_mask"][:, :-1]       # label-aligned: position t scores token t + 1
        return (nll * mask).sum() / mask.sum()

    @torch.no_grad()
    def accuracy(self) -> float:
        """Greedy held-out accuracy as the run reports it (``eval/accuracy``, the rewards' mean): prompts of one
        length are decoded together, so no padding enters the numbers."""
        self.model.eval()
        prompts = self.task.eval_prompts()
        by_length: dict[int, list[int]] = {}
        encoded = [self.prompt(p, m) for p, m in prompts]
        for i, (prompt, _) in enumerate(encoded):
            by_length.setdefault(len(prompt), []).append(i)
        texts = [""] * len(prompts)
        for length, rows in by_length.items():
            same_length = torch.tensor([encoded[i][0] for i in rows])
            if self.images is None:
                out = self.model.generate(same_length, attention_mask=torch.ones_like(same_length), do_sample=False,
                                          max_new_tokens=self.max_response_len, eos_token_id=self.eos,
                                          pad_token_id=self.eos)
            else:
                out = self.greedy(same_length, [encoded[i][1] for i in rows])
            for i, response in zip(rows, out[:, length:].tolist()):
                if self.eos in response:
                    response = response[: response.index(self.eos) + 1]
                texts[i] = self.tokenizer.decode(response, skip_special_tokens=True)
        self.model.train()
        scores = self.score(texts, [m for _, m in prompts])
        return eval_metrics(scores.total.view(-1, 1), [m.get("data_source", "") for _, m in prompts])["eval/accuracy"]

    def greedy(self, prompts: torch.Tensor, images: list[ImageInputs | None]) -> torch.Tensor:
        """Greedy continuations of same-length prompts with images, a whole forward per token (transformers'
        generate would need the image token types extended as it goes); rows past their EOS keep going unread."""
        tokens = prompts
        for _ in range(self.max_response_len):
            logits = self.forward(tokens, images)[:, -1]
            if self.images is not None:
                logits[:, list(self.images.reserved)] = float("-inf")   # as the engine: placeholders never sampled
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens

