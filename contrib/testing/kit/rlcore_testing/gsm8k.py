"""A verl user's GSM8K job in miniature, built in-process: a byte-level BPE tokenizer with Qwen3's special tokens
and chat template, and GSM8K-format rows (question, answer ending in "#### n") for `rlcore dataset gsm8k`. Used by
the GSM8K end-to-end test, the prompt-rendering tests and scripts/reference_runs.py."""
from __future__ import annotations

QWEN_STYLE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """A byte-level BPE tokenizer trained here, with Qwen3's special tokens and a Qwen3-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["What is 2+3? Let's think step by step.", "Natalia sold 48 clips in April.", "Be brief."] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=QWEN_STYLE_TEMPLATE)


def gsm8k_lines(count: int, offset: int) -> list[dict]:
    """``count`` GSM8K-format rows (one-step additions in words), numbered from ``offset``."""
    lines = []
    for i in range(offset, offset + count):
        apples, bought = 3 + i, 2 * i + 1
        lines.append({"question": f"Tom has {apples} apples. At the market he buys {bought} more apples and gives "
                                  f"none away. How many apples does Tom have now?",
                      "answer": f"Tom has {apples} + {bought} = <<{apples}+{bought}={apples + bought}>>"
                                f"{apples + bought} apples.\n#### {apples + bought}"})
    return lines
