"""The `dataset` task: prompts from files (verl's Parquet schema as is, or JSONL / JSON / Parquet through a column
mapping), rendered with the checkpoint's chat template once the tokenizer is known, overlong prompts counted and left
out. Each sample's metadata holds ``answer`` (the ground truth), ``data_source`` and ``extra_info`` for the reward;
``messages`` the prompt as chat messages (for the tools agent, which renders them with its tools); ``images`` the row's
images (``image_key``, verl's ``images`` column), one per ``<image>`` tag of its prompt; unless a reward is configured,
each row is scored by the reward registered for its ``data_source``."""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import List

from rlcore.datasets import Columns, EpochSampler, PromptRenderer, RenderedPrompt, read_prompt_files
from rlcore.datasets import render_and_filter
from rlcore.errors import ConfigError
from rlcore.multimodal import IMAGES
from rlcore.specs import Task, TaskSpec


@dataclass
class DatasetOptions:
    train_files: List[str] = field(default_factory=list)   # .parquet / .jsonl / .json
    val_files: List[str] = field(default_factory=list)     # scored at every evaluation (greedy); none = no evaluation
    prompt_key: str = "prompt"                   # a column of text or chat messages; dotted names reach into structs
    answer_key: str = "reward_model.ground_truth"
    source_key: str = "data_source"              # rows without it get default_source
    extra_key: str = "extra_info"
    image_key: str = "images"                    # a list of images per row (vision-language models), if present
    default_source: str = ""
    max_prompt_len: int = 512                    # longer rendered prompts are left out and counted
    chat_template: bool = True                   # false: prompts are plain text (base models)
    chat_template_file: str = ""                 # a Jinja chat template to use instead of the tokenizer's
    shuffle: bool = True                         # a seeded shuffle per epoch


class Dataset(Task):
    def __init__(self, options: DatasetOptions, seed: int):
        columns = Columns(options.prompt_key, options.answer_key, options.source_key, options.extra_key,
                          options.image_key)
        self.options = options
        self.train_records = read_prompt_files(options.train_files, columns, options.default_source)
        self.val_records = read_prompt_files(options.val_files, columns, options.default_source) \
            if options.val_files else []
        self.seed = seed
        self.train: list[RenderedPrompt] = []
        self.val: list[RenderedPrompt] = []
        self.left_out = 0
        self.sampler: EpochSampler | None = None
        self._step = -1
        self._drawn: list[int] = []        # the prompts drawn for the current step (dynamic sampling may ask again)

    def bind_tokenizer(self, tokenizer) -> None:
        template: bool | str = self.options.chat_template
        if self.options.chat_template_file:
            try:
                with open(self.options.chat_template_file, encoding="utf-8") as f:
                    template = f.read()
            except OSError as e:
                raise ConfigError(f"task.options.chat_template_file: {e}") from e
        renderer = PromptRenderer(tokenizer, template)
        self.train, self.left_out = render_and_filter(self.train_records, renderer, self.options.max_prompt_len,
                                                      "task.options.train_files")
        if self.val_records:
            self.val, dropped = render_and_filter(self.val_records, renderer, self.options.max_prompt_len,
                                                  "task.options.val_files")
            self.left_out += dropped
        self.sampler = EpochSampler(len(self.train), self.seed, self.options.shuffle)
        print(f"rlcore: {len(self.train)} training prompts ({self.left_out} left out as too long); the first, as the "
              f"model sees it:\n{self.train[0].text}", file=sys.stderr)

    def longest_prompt(self):
        if self.sampler is None:
            raise RuntimeError("the dataset task renders prompts with the model's tokenizer: bind_tokenizer first")
        return max(len(p.ids) for p in self.train + self.val), "task.options.max_prompt_len"

    @staticmethod
    def _example(prompt: RenderedPrompt) -> tuple[str, dict]:
        r = prompt.record
        messages = [{"role": "user", "content": r.prompt}] if isinstance(r.prompt, str) else list(r.prompt)
        meta = {"answer": r.answer, "data_source": r.source, "extra_info": r.extra, "messages": messages}
        return prompt.text, {**meta, IMAGES: r.images} if r.images else meta

    def train_prompts(self, step, count):
        if self.sampler is None:
            raise RuntimeError("the dataset task renders prompts with the model's tokenizer: bind_tokenizer first")
        if step != self._step:
            self._step, self._drawn = step, []
        if count > len(self._drawn):    # a larger count at the same step extends the list (dynamic sampling)
            self._drawn.extend(self.sampler.take(count - len(self._drawn)))
        return [self._example(self.train[i]) for i in self._drawn[:count]]

    def eval_prompts(self):
        return [self._example(p) for p in self.val]

    def data_sources(self):
        return dict(Counter(r.source for r in self.train_records + self.val_records))

    def state_dict(self):
        if self.sampler is None:
            raise RuntimeError("the dataset task's sampler starts in bind_tokenizer")
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state):
        if self.sampler is None:
            raise RuntimeError("the dataset task's sampler starts in bind_tokenizer")
        self.sampler.load_state_dict(state["sampler"])
        self._step, self._drawn = -1, []


def _build(options: dict, seed: int) -> Dataset:
    from rlcore.config import bind_plugin_section

    return Dataset(bind_plugin_section("task.options", options, DatasetOptions), seed)


DATASET = TaskSpec("dataset", _build, default_reward="",
                   description="prompts from Parquet/JSONL/JSON files (verl's schema or a column mapping), rendered "
                               "with the chat template; each row scored by the reward of its data_source")
