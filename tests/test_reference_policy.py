"""The frozen reference policy used by KL terms: equal to the actor when frozen, unchanged by later updates."""
import pytest
import torch

from rlcore.data import Batch, build_sequences
from rlcore.losses import aggregate

pytestmark = pytest.mark.slow


def test_reference_is_a_frozen_copy(quickstart):
    actor = quickstart.workers.workers[0].actor
    batch = Batch(build_sequences([quickstart.encode("3+4=")] * 4, [quickstart.encode("7")] * 4, quickstart.eos_id))
    saved = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.freeze_reference()
    try:
        before = actor.logprobs(batch)
        assert torch.equal(actor.logprobs(batch, reference=True), before)
        tokens = float(batch["response_mask"].sum())
        actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", tokens, 4), {}))
        assert not torch.equal(actor.logprobs(batch), before), "the update changed the actor"
        assert torch.equal(actor.logprobs(batch, reference=True), before), "and left the reference alone"
    finally:
        with torch.no_grad():
            for n, p in actor.model.named_parameters():
                p.copy_(saved[n])
        actor.reference = None
        quickstart.workers.workers[0].engine.sync_weights()
