"""The weight push between processes (rlcore.weight_sync.push): a sender and two receivers in processes of their own,
as the trainer's rank 0 and the rollout workers are; both transports.

- three pushes in a row arrive bitwise (float32, bfloat16, float16, int64, int8, bool, a 0-dim and an empty tensor,
  and one tensor bigger than the bucket), the receivers constructed before the sender exists;
- one receiver keeps every tensor of a push until after the next, as an engine may keep a layer's tensors: what it
  kept stays intact and the next push is still right (shared memory maps fresh slots instead of overwriting);
- the sender lives inside a default gloo world of its own (init_process_group), which still works afterwards;
- a sender killed or hung mid-push makes both receivers raise within the timeout, naming the sender and the version;
- no /dev/shm segment is left behind."""
import glob
import multiprocessing
import os
import queue
import signal
import time
import traceback

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

CAPACITY = 1024      # bytes per bucket: the 3 KB tensor below gets a bucket of its own
RECEIVERS = 2


def push(version: int) -> list[tuple[str, torch.Tensor]]:
    """What the sender pushes at ``version``: the same names, dtypes and shapes each time, different values."""
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(7, 9, generator=g)),
            ("layers.0.attn.weight", torch.randn(5, 11, generator=g).bfloat16()),
            ("layers.0.norm.weight", torch.randn(13, generator=g).half()),
            ("big.weight", torch.randn(24, 32, generator=g)),                 # 3072 bytes > CAPACITY
            ("router.bias", torch.randint(-2**40, 2**40, (6,), generator=g)),
            ("quant.scale", torch.randint(-128, 127, (3, 3), generator=g, dtype=torch.int8)),
            ("mask", torch.rand(10, generator=g) > 0.5),
            ("scalar", torch.tensor(float(version))),
            ("empty", torch.zeros(0, 4)),
            ("lm_head.weight", torch.randn(6, 8, generator=g).t())]          # not contiguous


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def check(got: list[tuple[str, torch.Tensor]], version: int) -> None:
    want = push(version)
    assert [n for n, _ in got] == [n for n, _ in want], [n for n, _ in got]
    bad = [n for (n, a), (_, b) in zip(got, want) if not bitwise_equal(a, b)]
    assert not bad, f"v{version}: {bad} differ"


def _child(report, fn, *args) -> None:
    try:
        report.put((fn.__name__, args[0] if args else None, fn(*args)))
    except BaseException:
        report.put((fn.__name__, args[0] if args else None, "FAILED " + traceback.format_exc()))


def receiver(rank: int, address: str, transport: str, pushes: int, keep: bool, timeout_s: float):
    from rlcore.weight_sync.push import WeightPushError, WeightPushReceiver

    channel = WeightPushReceiver(address, rank, RECEIVERS, CAPACITY, transport, timeout_s=timeout_s)
    kept: list = []
    try:
        for expected in range(pushes):
            version, tensors = channel.receive()
            assert version == expected, (version, expected)
            got = list(tensors) if keep else [(n, t.clone()) for n, t in tensors]
            check(got, version)
            if kept:    # the previous push's tensors, held through this whole push
                check(kept, version - 1)
            kept = got
    except WeightPushError as e:
        return {"error": str(e), "at": time.time(), "prefix": channel.prefix}
    finally:
        channel.close()
    return {"transport": channel.transport, "remapped": channel.remapped, "prefix": channel.prefix}


def sender(address: str, transport: str, pushes: int, die: tuple[int, int] | None):
    """Inside an initialised default gloo world of its own; ``die``: (push, signal) to send itself mid-stream."""
    import torch.distributed as dist

    from rlcore.launch import free_port
    from rlcore.weight_sync.push import WeightPushSender

    time.sleep(1.0)     # the receivers are constructed and waiting before the sender exists
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    channel = WeightPushSender(address, RECEIVERS, CAPACITY, transport, timeout_s=30)
    stats = []
    for version in range(pushes):
        def stream():
            for i, item in enumerate(push(version)):
                if die and version == die[0] and i == 4:
                    with open(os.environ["RLCORE_TEST_KILLED_AT"], "w") as f:
                        f.write(str(time.time()))
                    os.kill(os.getpid(), die[1])
                yield item
        stats.append(channel.send(stream(), version))
    channel.landed()        # send returns before the receivers have loaded the last push
    remapped = channel.remapped
    channel.close()
    total = torch.ones(1)
    dist.all_reduce(total)          # the default world still works
    dist.destroy_process_group()
    return {"stats": [(s.bytes, s.tensors, s.buckets) for s in stats], "remapped": remapped}


def run(address: str, transport: str, pushes: int, keep_rank: int | None, die: tuple[int, int] | None,
        timeout_s: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(report, receiver, rank, address, transport, pushes,
                                              rank == keep_rank, timeout_s), daemon=True)
             for rank in range(1, RECEIVERS + 1)]
    procs.append(ctx.Process(target=_child, args=(report, sender, address, transport, pushes, die), daemon=True))
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(RECEIVERS + (die is None)):
            name, first, result = report.get(timeout=60)
            results[first if name == "receiver" else "sender"] = result
    except queue.Empty:
        raise AssertionError(f"no word from a process within 60 s; got {results}")
    finally:
        for p in procs:
            p.join(timeout=10 if die is None else 0)   # a stopped sender waits for its SIGKILL
            if p.is_alive():
                p.kill()
    failed = sorted((str(who), r) for who, r in results.items() if isinstance(r, str) and r.startswith("FAILED"))
    assert not failed, "\n".join(f"{who}: {r}" for who, r in failed)   # the receivers' own errors first
    return results


@pytest.mark.parametrize("transport", ["shm", "collectives"])
def test_pushes_arrive_bitwise_and_kept_tensors_stay_intact(transport):
    from rlcore.launch import free_port

    results = run(f"127.0.0.1:{free_port()}", transport, pushes=3, keep_rank=1, die=None, timeout_s=30)
    want = push(0)
    nbytes = sum(t.numel() * t.element_size() for _, t in want)
    assert results["sender"]["stats"] == [(nbytes, len(want), 3)] * 3, results["sender"]
    assert {results[r]["transport"] for r in (1, 2)} == {transport}
    if transport == "shm":      # receiver 1 held both slots: fresh ones were mapped, on every rank alike
        assert results["sender"]["remapped"] > 0 and results[1]["remapped"] == results["sender"]["remapped"]
    assert not glob.glob(results[1]["prefix"] + "*")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_sender_gone_mid_push_makes_the_receivers_raise_naming_it(how, tmp_path, monkeypatch):
    from rlcore.launch import free_port

    monkeypatch.setenv("RLCORE_TEST_KILLED_AT", str(tmp_path / "killed_at"))
    address = f"127.0.0.1:{free_port()}"
    results = run(address, "auto", pushes=3, keep_rank=None, die=(1, how), timeout_s=5)
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in (1, 2):
        error = results[rank]["error"]
        assert "weight push v1" in error and f"the sender (channel rank 0 at {address})" in error, error
        assert "\n" not in error, error
        assert results[rank]["at"] - killed_at < 5 + 2, (rank, results[rank]["at"] - killed_at)   # 5: timeout_s
    assert not glob.glob(results[1]["prefix"] + "*")


def holding_receiver(rank: int, address: str, sent) -> str:
    """Takes every tensor of one push but holds back from the end of it until the sender says ``send`` returned."""
    from rlcore.weight_sync.push import WeightPushReceiver

    channel = WeightPushReceiver(address, rank, RECEIVERS, CAPACITY, "auto", timeout_s=30)
    try:
        version, tensors = channel.receive()
        check([(n, t.clone()) for n, t in (next(tensors) for _ in push(version))], version)
        if not sent.wait(30):
            return "FAILED the sender's send did not return before this receiver had taken the push whole"
        assert next(tensors, None) is None      # the end of the push: answers the sender's END
    finally:
        channel.close()
    return "took it"


def landing_sender(address: str, sent) -> str:
    from rlcore.weight_sync.push import WeightPushSender

    channel = WeightPushSender(address, RECEIVERS, CAPACITY, "auto", timeout_s=30)
    try:
        channel.send(iter(push(0)), 0)
        sent.set()
        channel.landed()        # returns once both receivers have answered the end
    finally:
        channel.close()
    return "landed"


def test_send_returns_before_the_receivers_have_loaded_and_landed_waits_for_them():
    """The trainer goes on while the engines load (rollout.max_staleness >= 1): ``send`` does not wait for the
    receivers to take the push whole; ``landed`` (and the next ``send``) does."""
    from rlcore.launch import free_port

    ctx = multiprocessing.get_context("spawn")
    report, sent = ctx.Queue(), ctx.Event()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(report, holding_receiver, rank, address, sent), daemon=True)
             for rank in range(1, RECEIVERS + 1)]
    procs.append(ctx.Process(target=_child, args=(report, landing_sender, address, sent), daemon=True))
    for p in procs:
        p.start()
    try:
        results = sorted(str(report.get(timeout=60)[2]) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results == ["landed", "took it", "took it"], results
