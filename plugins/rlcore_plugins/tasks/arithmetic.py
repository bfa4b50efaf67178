"""Built-in synthetic task: integer addition ("37+45=" -> "82"), with a character-level tokenizer so that a
tiny model can be built and trained locally with nothing downloaded."""
from __future__ import annotations

import random
from dataclasses import dataclass

from rlcore.errors import ConfigError
from rlcore.specs import Task, TaskSpec

EOS = "<|endoftext|>"
CHARS = "0123456789+-*= "
EVAL_SPLIT_SEED = 1234   # the held-out set does not depend on the run seed, so runs are comparable


@dataclass
class AdditionOptions:
    digits: int = 2          # operands are drawn from [0, 10**digits)
    eval_size: int = 200     # held-out pairs, never used for training


class Addition(Task):
    def __init__(self, options: AdditionOptions, seed: int):
        if options.digits < 1 or options.digits > 4:
            raise ConfigError(f"task.options.digits = {options.digits}: use 1 to 4")
        top = 10 ** options.digits
        pairs = [(a, b) for a in range(top) for b in range(top)]
        if options.eval_size >= len(pairs):
            raise ConfigError(f"task.options.eval_size = {options.eval_size} leaves no training pairs "
                             f"({len(pairs)} in all for {options.digits} digits)")
        random.Random(EVAL_SPLIT_SEED).shuffle(pairs)
        self.eval_pairs, self.train_pairs = pairs[: options.eval_size], pairs[options.eval_size:]
        self.seed = seed

    @staticmethod
    def _example(a: int, b: int) -> tuple[str, dict]:
        return f"{a}+{b}=", {"answer": str(a + b)}

    def _draw(self, stream: int, step: int, count: int) -> list[tuple[int, int]]:
        rng = random.Random(f"{self.seed}/{stream}/{step}")
        return [rng.choice(self.train_pairs) for _ in range(count)]

    def train_prompts(self, step, count):
        return [self._example(a, b) for a, b in self._draw(0, step, count)]

    def eval_prompts(self):
        return [self._example(a, b) for a, b in self.eval_pairs]

    def supervised_examples(self, step, count):
        return [(p, m["answer"]) for p, m in (self._example(a, b) for a, b in self._draw(1, step, count))]

    def preference_pairs(self, count, held_out):
        """The right sum preferred to a wrong answer, of the kinds a policy learning addition writes: a near miss
        (one digit off, off by one or ten, a digit dropped or added, another number of its length) or a malformed
        one (stray characters after the sum, or characters at random)."""
        rng = random.Random(f"{self.seed}/preferences/{held_out}")
        operands = self.eval_pairs if held_out else self.train_pairs
        pairs = []
        for _ in range(count):
            a, b = rng.choice(operands)
            prompt, meta = self._example(a, b)
            pairs.append((prompt, meta["answer"], wrong_answer(meta["answer"], rng)))
        return pairs

    def write_tokenizer(self, directory):
        return write_char_tokenizer(directory)


KINDS_OF_WRONG = (35, 15, 15, 10, 5, 10, 10)      # how often wrong_answer makes each kind


def wrong_answer(right: str, rng: random.Random) -> str:
    """A wrong answer to the sum ``right`` (a non-negative integer's digits), never ``right`` itself: mostly near
    misses in the last digits, where a policy that has learned most of addition still errs."""
    while True:
        kind = rng.choices(range(len(KINDS_OF_WRONG)), weights=KINDS_OF_WRONG)[0]
        if kind in (0, 1):             # the last digit changed, or any one
            i = len(right) - 1 if kind == 0 else rng.randrange(len(right))
            wrong = right[:i] + rng.choice("0123456789".replace(right[i], "")) + right[i + 1:]
        elif kind == 2:
            wrong = str(max(0, int(right) + rng.choice((-10, -1, 1, 10))))
        elif kind == 3:                # a digit dropped or added
            wrong = right[:-1] if rng.random() < 0.5 else right + rng.choice("0123456789")
        elif kind == 4:
            wrong = str(rng.randrange(10 ** (len(right) - 1) if len(right) > 1 else 0, 10 ** len(right)))
        elif kind == 5:                # the sum, then stray characters
            wrong = right + "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 2)))
        else:                          # anything
            wrong = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 4)))
        if wrong != right:
            return wrong


def write_char_tokenizer(directory: str) -> int:
    """A one-token-per-character HF tokenizer (tokenizer.json), loadable by transformers and vLLM."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS).save_pretrained(directory)
    return len(vocab)


def _build(options: dict, seed: int) -> Addition:
    from rlcore.config import bind_plugin_section

    return Addition(bind_plugin_section("task.options", options, AdditionOptions), seed)


ADDITION = TaskSpec("addition", _build, default_reward="exact_match",
                    description="integer addition a+b=, exact-match reward; char-level tokenizer")
