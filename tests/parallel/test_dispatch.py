"""The controller hands each data-parallel share to Ray workers as one object-store put, however many ranks read
it, and gets the same results back as from the in-process worker (``ActorGroup`` around ``EchoWorker``, no model)."""
import pickle

import pytest
import torch

from rlcore.config import load_config
from rlcore.data import Batch, build_sequences
from rlcore.workers.echo import EchoWorker
from rlcore.workers.proxies import ActorGroup


def test_batch_travels_out_of_band_and_owns_what_it_reads_back():
    """As Ray moves it: the tensors' bytes beside the pickle, read back from read-only (shared) memory."""
    b = Batch({"ids": torch.arange(12).view(3, 4), "mask": torch.rand(3, 4) > 0.5, "half": torch.randn(3, 2).bfloat16(),
               "cols": torch.randn(4, 3).t()}, [{"row": i} for i in range(3)])
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert sum(x.raw().nbytes for x in buffers) == sum(v.nbytes for v in b.tensors.values())
    shared = [bytes(x.raw()) for x in buffers]
    back = pickle.loads(data, buffers=shared)
    assert back.meta == b.meta
    for k, v in b.tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    back["ids"] += 1      # the copy is the reader's own: the shared bytes are unchanged
    assert pickle.loads(data, buffers=shared)["ids"].equal(b["ids"])


def test_routes_are_read_where_the_object_store_put_them():
    """The routed experts (most of a batch's bytes with routing replay) are indexed, never written: every rank of a
    node reads the one shared copy; the rest is copied, each rank's own."""
    from rlcore.routed_experts import ROUTED_EXPERTS

    b = Batch({"ids": torch.arange(12).view(3, 4), ROUTED_EXPERTS: torch.randint(0, 8, (3, 4, 2, 2)).short()})
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    shared = [memoryview(bytearray(x.raw())).toreadonly() for x in buffers]    # as Ray's plasma gives them
    back = pickle.loads(data, buffers=shared)
    assert torch.equal(back[ROUTED_EXPERTS], b[ROUTED_EXPERTS]) and torch.equal(back["ids"], b["ids"])
    in_store = {_address(x) for x in shared}
    assert back[ROUTED_EXPERTS].data_ptr() in in_store, "the routes were copied"
    assert back["ids"].data_ptr() not in in_store
    assert back.select([2, 0])[ROUTED_EXPERTS].equal(b[ROUTED_EXPERTS][[2, 0]])     # a micro-batch: a copy


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def group(world: int, tp: int) -> ActorGroup:
    cfg = load_config("quickstart", [f"trainer.world_size={world}", f"actor.parallel.tp={tp}"])
    return ActorGroup(cfg, None, "", worker_cls=EchoWorker)


def batch(rows: int = 6) -> Batch:
    torch.manual_seed(0)
    b = Batch(build_sequences([[1, 2, 3]] * rows, [[4] * (i + 1) for i in range(rows)], pad_id=0),
              [{"row": i} for i in range(rows)])
    b["old_logprobs"] = torch.randn(b["input_ids"].shape)
    return b


@pytest.mark.parallel
def test_a_share_is_put_once_for_its_ranks_and_results_are_unchanged(monkeypatch):
    """Two Ray workers, TP peers of one data-parallel share: one put, the reporting rank's answer. (Four workers in
    two shares took 15 s against 9 s here, mostly starting Ray's processes; the dp2 layouts of tests/parallel split
    a batch over Ray workers.)"""
    import ray

    local = group(1, 1)
    expected = local.logprobs(batch()), local.train_step(batch(), True)
    workers = group(2, 2)
    puts, put = [], ray.put

    def counted(value, **kwargs):
        puts.append(value)
        return put(value, **kwargs)

    monkeypatch.setattr(ray, "put", counted)
    try:
        assert torch.equal(workers.logprobs(batch()), expected[0])
        assert [len(p) for p in puts] == [6]                   # one put for the share, not one per rank
        assert workers.train_step(batch(), True) == expected[1]
        assert len(puts) == 2
    finally:
        workers.stop()
