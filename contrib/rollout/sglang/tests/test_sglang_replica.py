"""A replica's ranks without the engine get the leader's answer to each of their requests (2 processes, gloo), though
the leader's requests finish in another order than they were issued and an agent's second turn is issued after its
first turn's answer; an error on the leader reaches the other rank. No SGLang needed: the answers are stand-ins."""
import subprocess
import textwrap

import pytest

from rlcore.launch import torchrun

pytestmark = [pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import asyncio, torch.distributed as dist
    from rlcore_rollout_sglang.replica import Replica
    dist.init_process_group("gloo")
    replica = Replica(2, distributed=True)
    assert replica.leads == (dist.get_rank() == 0)
    FINISH = {"a": 0.06, "b": 0.1, "c": 0.01, "x1": 0.02, "x2": 0.01, "e": 0.08}    # seconds after issue

    async def engine(request_id):           # the leader's answers: x2 is answered before a, though issued after it
        await asyncio.sleep(FINISH[request_id])
        if request_id == "e":
            raise ValueError("the engine broke")
        return f"answer to {request_id}"

    async def ask(request_id):
        return await replica.share_answer(request_id, engine(request_id) if replica.leads else None)

    async def agent():                      # a two-turn episode: its second request waits for its first answer
        first = await ask("x1")
        return [first, await ask("x2")]

    async def errs():
        try:
            await ask("e")
        except Exception as error:
            return type(error).__name__
        return "no error"

    async def main():
        return await asyncio.gather(ask("a"), ask("b"), ask("c"), agent(), errs())

    got = asyncio.new_event_loop().run_until_complete(main())
    want = ["answer to a", "answer to b", "answer to c", ["answer to x1", "answer to x2"],
            "ValueError" if replica.leads else "RuntimeError"]
    assert got == want, got
    assert not replica._arrived, replica._arrived
    print(f"REPLICA OK {dist.get_rank()}", flush=True)
    del replica
    dist.destroy_process_group()
""")


def test_every_rank_gets_the_answer_to_its_own_request(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = subprocess.run([*torchrun(2), str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.count("REPLICA OK") == 2, result.stderr[-4000:]
