"""Three GRPO steps with a tiny Llama 3.1 (llama3-scaled RoPE) through `rlcore run --plugins=llama,grpo,<engine>` on
vLLM and on SGLang: the engine is checked against the actor after every weight push (run_grpo_smoke: max logprob
difference < 1e-3), so the engines' scaled RoPE is the actor's."""
import pytest

from rlcore_testing.models import run_grpo_smoke
from runs import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_grpo_steps_with_engine_checks(engine, tmp_path):
    history = run_grpo_smoke(f"llama,grpo,{engine}", "llama", str(tmp_path / "run"), 3, f"rollout.backend={engine}",
                             run=run_cli)
    assert all(h["sync/bytes"] > 0 for h in history[1:])
