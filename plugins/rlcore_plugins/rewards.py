"""Built-in reward functions."""
from rlcore.specs import RewardSpec


def exact_match(responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when the response, stripped of surrounding whitespace, equals ``metadata['answer']``."""
    return [float(r.strip() == str(m["answer"])) for r, m in zip(responses, metadata)]


SPECS = [RewardSpec("exact_match", exact_match)]
