"""The tool task: multiplication of 3-digit numbers, which a tiny model cannot do unaided, with a ``calculator``
environment whose ``multiply`` tool can. The model is built locally with a tokenizer and chat template of its own
(Qwen's turn markers and tool-call tags, one token per character otherwise); a warm start on synthetic traces
teaches the format, most of them answering unaided (wrong, nearly always) and ``tool_frac`` of them calling the
tool and copying its result. RL then has to find out that calling the tool pays: held-out accuracy (greedy, through
the tools agent) rises as the policy learns to call it."""
from __future__ import annotations

import functools
import random
import string
from dataclasses import dataclass

from rlcore.errors import ConfigError
from rlcore.specs import Task, TaskSpec
from rlcore_agent_tools.specs import EnvironmentSpec

EVAL_SPLIT_SEED = 4321
EOS, PAD, START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
CALL_OPEN = '{"name": "multiply", "arguments": {"a": '
# multi-character pieces the tokenizer keeps whole (the rest is one token per character)
WORDS = ["<tool_call>", "</tool_call>", CALL_OPEN, ', "b": ', "}}", "assistant", "user", "tool"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class ToolArithmeticOptions:
    digits: int = 3          # both factors have this many digits
    eval_size: int = 200     # held-out pairs, never used for training
    tool_frac: float = 0.2   # warm-start traces that call the tool (the rest answer unaided)


class Calculator:
    """The ``calculator`` environment: a multiplication tool."""

    def reset(self, **row) -> None:
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b


class ToolArithmetic(Task):
    def __init__(self, options: ToolArithmeticOptions, seed: int):
        if not 1 <= options.digits <= 4:
            raise ConfigError(f"task.options.digits = {options.digits}: use 1 to 4")
        if not 0.0 <= options.tool_frac <= 1.0:
            raise ConfigError(f"task.options.tool_frac = {options.tool_frac}: use a fraction from 0 to 1")
        low, high = 10 ** (options.digits - 1), 10 ** options.digits
        rng = random.Random(EVAL_SPLIT_SEED)
        self.eval_pairs = sorted({(rng.randrange(low, high), rng.randrange(low, high))
                                  for _ in range(options.eval_size)})
        self.low, self.high, self.options, self.seed = low, high, options, seed

    def _draw(self, stream: int, step: int, count: int) -> list[tuple[int, int]]:
        rng, held_out = random.Random(f"{self.seed}/{stream}/{step}"), set(self.eval_pairs)
        pairs: list[tuple[int, int]] = []
        while len(pairs) < count:
            pair = (rng.randrange(self.low, self.high), rng.randrange(self.low, self.high))
            if pair not in held_out:
                pairs.append(pair)
        return pairs

    @staticmethod
    def _example(a: int, b: int) -> tuple[str, dict]:
        messages = [{"role": "user", "content": f"{a}*{b}"}]
        return render(messages, generation_prompt=True), {"answer": str(a * b), "messages": messages}

    def train_prompts(self, step, count):
        return [self._example(a, b) for a, b in self._draw(0, step, count)]

    def eval_prompts(self):
        return [self._example(a, b) for a, b in self.eval_pairs]

    def supervised_examples(self, step, count):
        """Traces as the tools agent builds them: ``tool_frac`` of them call ``multiply`` and copy its result, the
        others answer at once (the product, which the model cannot learn to compute)."""
        rng = random.Random(f"{self.seed}/warm/{step}")
        examples = []
        for a, b in self._draw(1, step, count):
            prompt, _ = self._example(a, b)
            if rng.random() < self.options.tool_frac:
                call = f"<tool_call>{CALL_OPEN}{a}, \"b\": {b}}}}}</tool_call>"
                completion = f"{call}{EOS}\n{START}tool\n{a * b}{EOS}\n{START}assistant\n{a * b}"
            else:
                completion = str(a * b)
            examples.append((prompt, completion))
        return examples

    def write_tokenizer(self, directory):
        return write_tool_tokenizer(directory)


def render(messages: list[dict], generation_prompt: bool) -> str:
    return chat_template().render(messages=messages, add_generation_prompt=generation_prompt)


@functools.cache
def chat_template():
    """The chat template compiled once: compiling it for every example was a quarter of the warm start's time."""
    from jinja2 import Template

    return Template(TEMPLATE)


def write_tool_tokenizer(directory: str) -> int:
    """One token per printable character, whole tokens for the chat markers and the tool call's fixed parts; eos is
    <|im_end|> (id 0), which ends every turn."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate([EOS, PAD, START, *WORDS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    pieces = "|".join(re.escape(w) for w in sorted(WORDS, key=len, reverse=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, chat_template=TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": [START]})
    fast.save_pretrained(directory)
    return len(vocab)


def _build(options: dict, seed: int) -> ToolArithmetic:
    from rlcore.config import bind_plugin_section

    return ToolArithmetic(bind_plugin_section("task.options", options, ToolArithmeticOptions), seed)


TOOL_ARITHMETIC = TaskSpec("tool_arithmetic", _build, default_reward="final_answer",
                           description="3-digit multiplication with a calculator tool (rollout.agent=tools "
                                       "agent.environment=calculator); char-level tokenizer with chat markers")
CALCULATOR = EnvironmentSpec("calculator", lambda options: Calculator(), "a multiply(a, b) tool")
