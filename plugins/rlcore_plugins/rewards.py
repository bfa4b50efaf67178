"""Built-in reward functions: exact match, GSM8K's final '#### <number>', and math answers compared symbolically."""
from __future__ import annotations

import re

from rlcore.specs import RewardSpec


def exact_match(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the response, stripped of surrounding whitespace, equals ``metadata['answer']``."""
    return [float(r.strip() == str(m["answer"])) for r, m in zip(responses, metadata)]


_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the number after the response's last ``####`` (GSM8K's solution format; commas and ``$`` ignored)
    equals ``metadata['answer']`` as a number; 0.0 otherwise, a response without ``####`` included."""
    def number(text: str) -> float | None:
        try:
            return float(text.replace(",", "").replace("$", "").strip())
        except ValueError:
            return None

    scores = []
    for response, meta in zip(responses, metadata):
        finals = _GSM8K_FINAL.findall(response.replace("$", ""))
        got, want = (number(finals[-1]) if finals else None), number(str(meta["answer"]))
        scores.append(float(got is not None and got == want))
    return scores


def math(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when Hugging Face's math-verify finds the response's final answer (``\\boxed{...}``, LaTeX or a plain
    expression) equal to ``metadata['answer']`` symbolically (1/2 = 0.5 = \\frac{1}{2}); 0.0 otherwise."""
    from math_verify import parse, verify

    scores = []
    for response, meta in zip(responses, metadata):
        gold = parse("\\boxed{" + str(meta["answer"]) + "}")
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {meta['answer']!r}")
        scores.append(float(bool(response.strip()) and verify(gold, parse(response))))
    return scores


# the data sources verl's datasets name, scored by these rewards unless the run maps them otherwise
SPECS = [RewardSpec("exact_match", exact_match, data_sources=("rlcore/addition",)),   # `rlcore dataset task addition`
         RewardSpec("gsm8k", gsm8k, data_sources=("openai/gsm8k",)),
         RewardSpec("math", math, data_sources=("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                                "HuggingFaceH4/MATH-500"))]
