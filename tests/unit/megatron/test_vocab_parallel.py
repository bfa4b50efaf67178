"""rlcore.megatron.vocab_parallel.entropy on one rank against an fp64 reference on the same fp32 logits: its value and
its gradient stay at fp32 precision at large logits (RL policies' logits reach tens; the entropy bonus trains on the
gradient)."""
import pytest
import torch

from rlcore.megatron.parallel import init_parallel
from rlcore.megatron.vocab_parallel import entropy


def reference_entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0])
def test_entropy_and_its_gradient_match_fp64_at_large_logits(scale):
    """Weighting the unshifted logits (e * z) gave errors of 1.2e-5 (value) and 7e-6 (gradient) at scale 10, 4e-5
    and 5e-5 at scale 100; the shifted ones (e * (z - max)) 3e-7 and 2e-7, 9e-8 and 9e-8."""
    init_parallel()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g) * scale
    weights = torch.randn(64, generator=g)
    want = logits.double().requires_grad_(True)
    (reference_entropy(want) * weights.double()).sum().backward()
    got = logits.clone().requires_grad_(True)
    value = entropy(got)
    (value * weights).sum().backward()
    torch.testing.assert_close(value.double(), reference_entropy(logits.double()), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=1e-6)
