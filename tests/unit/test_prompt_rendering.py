"""Prompts rendered with a Qwen3-style chat template on a BPE tokenizer trained here, and overlong filtering."""
import logging

import pytest

from rlcore.datasets import PromptRecord
from rlcore.datasets.prompts import PromptRenderer, render_and_filter
from rlcore.errors import ConfigError

def record(prompt, origin="train.parquet:0"):
    return PromptRecord(prompt=prompt, answer="5", source="openai/gsm8k", origin=origin)


def test_chat_messages_render_with_the_tokenizers_template(chat_tokenizer):
    renderer = PromptRenderer(chat_tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = renderer.text(record(messages))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = renderer.ids(record(messages))
    start, end = chat_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2 and chat_tokenizer.decode(ids) == text


def test_plain_text_prompts_are_a_user_message_or_used_as_they_are(chat_tokenizer):
    assert PromptRenderer(chat_tokenizer).text(record("What is 2+3?")) == \
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert PromptRenderer(chat_tokenizer, chat_template=False).text(record("What is 2+3?")) == "What is 2+3?"
    assert PromptRenderer(chat_tokenizer, chat_template="Q: {{ messages[-1]['content'] }}\nA:").text(
        record("What is 2+3?")) == "Q: What is 2+3?\nA:"


def test_template_mistakes_are_one_clear_error(chat_tokenizer):
    with pytest.raises(ConfigError, match="train.parquet:0: the prompt is a list of chat messages but "
                                          "task.options.chat_template is false"):
        PromptRenderer(chat_tokenizer, chat_template=False).text(record([{"role": "user", "content": "hi"}]))
    with pytest.raises(ConfigError, match="train.parquet:0: the chat template failed to render the prompt: "
                                          "TemplateError: no system prompts"):
        PromptRenderer(chat_tokenizer, chat_template="{{ raise_exception('no system prompts') }}").text(record("hi"))
    bare = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer)
    with pytest.raises(ConfigError, match="the tokenizer has no chat template: set task.options.chat_template=false"):
        PromptRenderer(bare)


def test_overlong_prompts_are_left_out_and_counted(chat_tokenizer, caplog):
    renderer = PromptRenderer(chat_tokenizer)
    short = [record("What is 2+3?", f"a.jsonl:{i}") for i in range(3)]
    long = [record("Natalia sold 48 clips in April. " * 8, f"b.jsonl:{i}") for i in range(2)]
    limit = max(len(renderer.ids(r)) for r in short)
    with caplog.at_level(logging.WARNING, logger="rlcore.datasets.prompts"):
        kept, dropped = render_and_filter(short + long, renderer, limit)
    assert [k.record for k in kept] == short and dropped == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"task.options.train_files: 2 prompt(s) longer than task.options.max_prompt_len={limit} tokens left out "
        "(2 from b.jsonl)"]
    with pytest.raises(ConfigError, match="every one of the 2 prompts is longer than task.options.max_prompt_len=3"):
        render_and_filter(long, renderer, 3)
