"""Built-in reward functions: exact match, GSM8K's final '#### <number>', and math answers compared symbolically."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from rlcore.specs import RewardSpec


def exact_match(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the response, stripped of surrounding whitespace, equals ``metadata['answer']``."""
    return [float(r.strip() == str(m["answer"])) for r, m in zip(responses, metadata)]


def final_answer(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the episode's last turn (``metadata['final_response']``, kept by the tools agent; the response
    itself otherwise), stripped of surrounding whitespace, equals ``metadata['answer']``."""
    return [float(m.get("final_response", r).strip() == str(m["answer"])) for r, m in zip(responses, metadata)]


# the number after '####', ending at a boundary: not followed by a letter or digit, nor by '.' or ',' and one
# ('#### 1.2.3' is no answer rather than 1.2; '#### 72.' ending a sentence is 72)
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)(?![.,]?\w)")


def _exact_number(text: str) -> Decimal | None:
    """``text`` as an exact decimal, commas and ``$`` ignored (as verl does); None if it is not a finite number."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def gsm8k(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the number after the response's last ``####`` (GSM8K's solution format; commas and ``$`` ignored)
    equals ``metadata['answer']`` exactly (as decimals: 2.50 = 2.5, but 10000000000000000 != 10000000000000001,
    which floats confuse); 0.0 otherwise, a response without ``####`` or with a malformed number included."""
    scores = []
    for response, meta in zip(responses, metadata):
        finals = _GSM8K_FINAL.findall(response.replace("$", ""))
        got, want = (_exact_number(finals[-1]) if finals else None), _exact_number(str(meta["answer"]))
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


# verl's geo3k format: reasoning in <think> </think>, then the answer boxed (verl/utils/reward_score/geo3k.py)
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k(responses: list[str], metadata: list[dict]) -> dict[str, list[float]]:
    """verl's geometry3k score: 0.9 x accuracy + 0.1 x format. Accuracy: the last ``\boxed{...}`` equals
    ``metadata['answer']`` (math-verify's symbolic comparison, where verl uses mathruler's ``grade_answer``); format:
    the response is ``<think>...</think>`` then a boxed answer."""
    accuracy = math([_last_boxed(r) for r in responses], metadata)
    form = [float(_GEO3K_FORMAT.fullmatch(r) is not None) for r in responses]
    return {"accuracy": [0.9 * a for a in accuracy], "format": [0.1 * f for f in form]}


def _last_boxed(text: str) -> str:
    """The last ``\boxed{...}`` of ``text`` (braces balanced), or "" when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return ""
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start: j + 1]
    return ""


def environment(responses: list[str], metadata: list[dict]) -> list[float] | dict[str, list[float]]:
    """What the episode's environment said when it ended (its ``reward()``, kept by the tools agent): a number, or
    named components that add up to it (each logged)."""
    if any("environment_reward" not in m for m in metadata):
        raise ValueError("no environment reward in the sample's metadata: the environment needs a reward() method "
                         "and the run rollout.agent=tools")
    values = [m["environment_reward"] for m in metadata]
    if all(isinstance(v, dict) for v in values):
        return {name: [float(v[name]) for v in values] for name in values[0]}
    return [float(v) for v in values]


# the data sources verl's datasets name, scored by these rewards unless the run maps them otherwise
SPECS = [RewardSpec("exact_match", exact_match, data_sources=("rlcore/addition",)),   # `rlcore dataset task addition`
         RewardSpec("gsm8k", gsm8k, data_sources=("openai/gsm8k",)),
         RewardSpec("math", math, data_sources=("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                                "HuggingFaceH4/MATH-500")),
         RewardSpec("geo3k", geo3k, data_sources=("hiyouga/geometry3k",)),
         RewardSpec("final_answer", final_answer), RewardSpec("environment", environment)]
