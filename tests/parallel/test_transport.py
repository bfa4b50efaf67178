"""The weight-sync exchanges (2 processes, gloo): shared memory and collectives deliver the same pieces, shared-memory
pieces are copied out by ``detach`` (nothing kept aliases a segment that the next bucket overwrites), an oversized
piece is refused, and no segment file is left in /dev/shm."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import glob, torch, torch.distributed as dist
    from rlcore.engine.transport import CollectiveExchange, SharedMemoryExchange, make_exchange
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    shm, coll = make_exchange(group, 1 << 12), make_exchange(group, 1 << 12, "collectives")
    assert isinstance(shm, SharedMemoryExchange) and isinstance(coll, CollectiveExchange), (shm, coll)
    assert not glob.glob("/dev/shm/rlcore-sync-*"), glob.glob("/dev/shm/rlcore-sync-*")
    mine = [torch.full((3,), float(rank)), torch.arange(4.0) + 10 * rank]
    for step in range(3):                       # the same segments serve bucket after bucket
        mine = [t + step for t in mine]
        want = [torch.cat([torch.full((3,), float(r)), torch.arange(4.0) + 10 * r]) + sum(range(step + 1))
                for r in range(2)]
        got_shm, got_coll = shm.gather(mine), coll.gather(mine)
        kept = [shm.detach(p) for p in got_shm]
        assert all(k.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for k, p in zip(kept, got_shm))
        shm.release()
        assert all(torch.equal(a, w) and torch.equal(b, w) for a, b, w in zip(kept, got_coll, want))
        sent = [torch.arange(5.0) * (step + 1)] if rank == 1 else None
        b_shm = shm.detach(shm.broadcast(sent, 5, torch.float32, src=1))
        shm.release()
        b_coll = coll.broadcast(sent, 5, torch.float32, src=1)
        assert torch.equal(b_shm, torch.arange(5.0) * (step + 1)) and torch.equal(b_coll, b_shm), (b_shm, b_coll)
    private = torch.ones(2)
    assert shm.detach(private) is private
    try:
        shm.gather([torch.zeros(2048)])
        raise AssertionError("an 8 KB piece fit a 4 KB segment")
    except ValueError as e:
        assert "exceed" in str(e), e
    print(f"TRANSPORT OK {rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()   # exiting with gloo's threads alive can abort ("terminate called without ...")
""")


def test_shared_memory_and_collectives_agree(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29655", str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.count("TRANSPORT OK") == 2, result.stderr[-4000:]
