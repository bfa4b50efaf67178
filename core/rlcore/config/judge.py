"""What the config loader checks of a generative judge's section (reward_model.kind=generative, reward_model.judge),
before anything starts: the rubric and the parser; ``rlcore.rollout.judge`` uses them."""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from rlcore.config.schema import JudgeConfig
from rlcore.errors import ConfigError

if TYPE_CHECKING:
    from rlcore.config.schema import Config

DEFAULT_PARSER = JudgeConfig.parser        # "Score: 7", "score=-2.5"


def load_template(value: str) -> str:
    """``reward_model.judge.template``: a file's text where it names a file, else the text itself; it must show the
    judge the response (``{response}``)."""
    path = os.path.expanduser(value)
    from_file = bool(value) and "\n" not in value and os.path.isfile(path)
    text = value
    if from_file:
        with open(path) as f:
            text = f.read()
    if "{response}" not in text:
        what = ("the file has no {response}" if from_file else
                "it names no file, and as a template it has no {response}" if value else "it is empty")
        shown = value if from_file else value[:80]      # a path whole; inline text cut
        raise ConfigError(f"config key 'reward_model.judge.template' = {shown!r} is not allowed ({what}): use "
                          f"a rubric, inline or a file's path, with {{response}} where the judge reads the response "
                          f"(and {{prompt}}, {{answer}} where it reads those)")
    return text


def compile_parser(pattern: str) -> re.Pattern:
    """``reward_model.judge.parser``: a regex with exactly one group, the score."""
    try:
        parser = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"config key 'reward_model.judge.parser' = {pattern!r} is not allowed (not a regex: {e}): "
                          f"use a regex with one group, the score, e.g. {DEFAULT_PARSER}") from None
    if parser.groups != 1:
        raise ConfigError(f"config key 'reward_model.judge.parser' = {pattern!r} is not allowed (it has "
                          f"{parser.groups} groups): use a regex with exactly one group, the score (make others "
                          f"non-capturing: (?:...))")
    return parser


def check_judge_config(cfg: Config) -> None:
    """What the config loader checks of reward_model.kind=generative (the files and the backend: ``load_judge``)."""
    rm, training = cfg.reward_model, cfg.reward_training
    if not rm.path:
        raise ConfigError("reward_model.kind = 'generative' without reward_model.path: give the judge, a causal LM "
                          "checkpoint (a Hugging Face directory)")
    if training.train_files or training.synthetic_pairs:
        raise ConfigError("reward_training trains a scalar reward model, and reward_model.kind = 'generative' judges "
                          "with reward_model.path: drop reward_training.* or use reward_model.kind=scalar")
    load_template(rm.judge.template)
    compile_parser(rm.judge.parser)
