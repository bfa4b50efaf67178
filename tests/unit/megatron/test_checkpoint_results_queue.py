"""Two checkpoint saves in flight in one process (a world-of-one run's actor and critic, saved together) each read
their own writers' results: megatron-core hands every save one process-wide results queue, from which a finished
save takes the first result as its own, so the other's could land in its metadata (rlcore's checkpoint shim gives
each save a queue of its own)."""
from rlcore.megatron import patches


def test_each_save_reads_only_its_own_write_results():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    patches.apply()
    actor, critic = filesystem_async._get_write_results_queue(), filesystem_async._get_write_results_queue()
    critic.put({0: ["the critic's write results"]})       # the critic's writers finish first
    actor.put({0: ["the actor's write results"]})
    assert actor.get(timeout=5) == {0: ["the actor's write results"]}
    assert critic.get(timeout=5) == {0: ["the critic's write results"]}
