"""After a weight push, vLLM's logprobs on a fixed batch equal the Megatron actor's (the engine's reusable check);
and the check does fail when the engine holds stale weights."""
import pytest
import torch

from rlcore.weight_sync.logprob_check import check_logprobs, compare_logprobs, fixed_probe
from rlcore.errors import RlcoreError

pytestmark = pytest.mark.slow


def test_logprobs_match_after_sync(quickstart):
    worker = quickstart.workers.workers[0]
    worker.engine.sync_weights()
    probe = fixed_probe(len(quickstart.tokenizer), count=16, seed=7)
    result = check_logprobs(worker.actor, worker.rollout, *probe, pad_id=quickstart.eos_id, tolerance=1e-3)
    assert result.tokens == 16 * 6 and result.max_abs_diff < 1e-3


def test_check_fails_on_stale_weights_and_passes_after_a_push(quickstart):
    actor, rollout = quickstart.workers.workers[0].actor, quickstart.workers.workers[0].rollout
    probe = fixed_probe(len(quickstart.tokenizer), count=8, seed=3)
    param = dict(actor.model.named_parameters())["decoder.layers.0.mlp.linear_fc2.weight"]
    with torch.no_grad():      # undone by the next test's restore (conftest.quickstart)
        param.add_(torch.randn_like(param) * 0.5)
    stale = compare_logprobs(actor, rollout, *probe, pad_id=quickstart.eos_id)
    assert stale.max_abs_diff > 1e-2
    with pytest.raises(RlcoreError, match="disagree after a weight sync"):
        check_logprobs(actor, rollout, *probe, pad_id=quickstart.eos_id, tolerance=1e-3)
    stats = quickstart.workers.workers[0].engine.sync_weights()
    assert stats.bytes == sum(p.numel() * 4 for p in actor.model.parameters())
    check_logprobs(actor, rollout, *probe, pad_id=quickstart.eos_id, tolerance=1e-3)
