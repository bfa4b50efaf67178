"""Prompt records as the text and token ids the policy sees: the checkpoint's chat template (or one from a file, or
none for base models), and prompts too long for ``max_prompt_len`` filtered out and counted at load time."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tqdm import tqdm

from rlcore.datasets.files import PromptRecord
from rlcore.errors import ConfigError

log = logging.getLogger(__name__)
SHOW_PROGRESS_FROM = 2000          # rendering and tokenizing this many prompts takes seconds: show a progress bar


class PromptRenderer:
    """``chat_template``: True = the tokenizer's own, False = the prompt text as it is (base models; chat messages
    are then refused), or a Jinja template string (e.g. read from a file)."""

    def __init__(self, tokenizer, chat_template: bool | str = True):
        self.tokenizer, self.template = tokenizer, chat_template
        if chat_template is True and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template: set task.options.chat_template=false for a base "
                              "model (prompts used as plain text) or give one with task.options.chat_template_file")

    def text(self, record: PromptRecord) -> str:
        prompt = record.prompt
        if self.template is False:
            if not isinstance(prompt, str):
                raise ConfigError(f"{record.origin}: the prompt is a list of chat messages but "
                                  f"task.options.chat_template is false; turn templating on, or give plain text")
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                **({} if self.template is True else {"chat_template": self.template}))
        except Exception as e:
            raise ConfigError(f"{record.origin}: the chat template failed to render the prompt: "
                              f"{type(e).__name__}: {e}") from e
        assert isinstance(text, str)
        return text

    def ids(self, record: PromptRecord) -> list[int]:
        return self.encode(self.text(record))

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt; the template already holds any special tokens it wants."""
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass
class RenderedPrompt:
    record: PromptRecord
    text: str                       # what the policy is prompted with (the chat template applied)
    ids: list[int]


def render_and_filter(records: list[PromptRecord], renderer: PromptRenderer, max_prompt_len: int,
                      what: str = "task.options.train_files") -> tuple[list[RenderedPrompt], int]:
    """Render every record; those longer than ``max_prompt_len`` tokens are left out and counted (a warning says how
    many, from which files). Returns the kept prompts and the count left out; nothing kept is an error."""
    kept: list[RenderedPrompt] = []
    dropped: dict[str, int] = {}          # file -> prompts left out
    progress = tqdm(records, desc=f"rendering {what}", unit="prompt", disable=len(records) < SHOW_PROGRESS_FROM,
                    dynamic_ncols=True)
    for record in progress:
        text = renderer.text(record)
        ids = renderer.encode(text)
        if len(ids) > max_prompt_len:
            file = record.origin.rsplit(":", 1)[0]
            dropped[file] = dropped.get(file, 0) + 1
        else:
            kept.append(RenderedPrompt(record, text, ids))
    if dropped:
        log.warning("%s: %d prompt(s) longer than task.options.max_prompt_len=%d tokens left out (%s)", what,
                    sum(dropped.values()), max_prompt_len, ", ".join(f"{n} from {f}" for f, n in dropped.items()))
    if not kept:
        raise ConfigError(f"{what}: every one of the {len(records)} prompts is longer than task.options.max_prompt_len="
                          f"{max_prompt_len} tokens; raise it")
    return kept, sum(dropped.values())
