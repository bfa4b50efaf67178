"""The weight push between processes on this host (rlcore.weight_sync.push): shared memory against gloo broadcasts.

    python bench/weight_push.py [--mb 256] [--bucket-mb 64] [--receivers 1] [--pushes 4] [--smoke]

A sender process pushes --mb of tensors (float32 and bfloat16, a few MB each, one bigger than a bucket) to
--receivers processes, each of which copies every tensor into parameters of its own, as an engine loads weights.
Both transports are set up side by side and their pushes alternate (after one warm-up each), so that drift on a busy
machine hits both alike. A push's time is the sender's: from its start until every receiver has taken the last
bucket. Prints each transport's median seconds and MB/s, and the floor: the receivers' copy alone (the same tensors
copied into the same parameters within one process). Last line: ``push shm/collectives <x>x`` (speed ratio).
``--smoke`` (tests/integration/test_bench_smoke.py): 8 MB in buckets of 2 MB, one timed push.
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

TRANSPORTS = ("shm", "collectives")


def model(mb: float, bucket_mb: float) -> list[tuple[str, torch.Tensor]]:
    """About ``mb`` MB of tensors: 4 MB float32 and 2 MB bfloat16 ones, and one of 1.5 buckets."""
    g = torch.Generator().manual_seed(0)
    big = int(1.5 * bucket_mb * 2**20 / 4)
    tensors = [("lm_head.weight", torch.randn(big, generator=g))]
    total, i = big * 4, 0
    while total < mb * 2**20:
        if i % 2:
            t = torch.randn(1024, 1024, generator=g)
        else:
            t = torch.randn(1024, 1024, generator=g).bfloat16()
        tensors.append((f"layers.{i}.weight", t))
        total, i = total + t.numel() * t.element_size(), i + 1
    return tensors


def receiver(rank: int, addresses: dict, receivers: int, capacity: int, pushes: int, report) -> None:
    from rlcore.weight_sync.push import WeightPushReceiver

    torch.set_num_threads(1)
    channels = {t: WeightPushReceiver(addresses[t], rank, receivers, capacity, t) for t in TRANSPORTS}
    params: dict[str, torch.Tensor] = {}
    for _ in range(pushes):
        for channel in channels.values():
            _, tensors = channel.receive()
            for name, tensor in tensors:
                if name not in params:
                    params[name] = torch.empty_like(tensor)
                params[name].copy_(tensor)
    report.put({t: c.remapped for t, c in channels.items()})
    for c in channels.values():
        c.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=256)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="8 MB, buckets of 2 MB, one push: a check that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.bucket_mb, args.pushes = 8, 2, 1

    from rlcore.launch import free_port
    from rlcore.weight_sync.push import WeightPushSender

    torch.set_num_threads(1)
    capacity, pushes = int(args.bucket_mb * 2**20), args.pushes + 1
    addresses = {t: f"127.0.0.1:{free_port()}" for t in TRANSPORTS}
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(r, addresses, args.receivers, capacity, pushes, report))
             for r in range(1, args.receivers + 1)]
    for p in procs:
        p.start()
    senders = {t: WeightPushSender(addresses[t], args.receivers, capacity, t) for t in TRANSPORTS}
    tensors = model(args.mb, args.bucket_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    seconds: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    for version in range(pushes):
        for t, sender in senders.items():
            start = time.perf_counter()
            sender.send(iter(tensors), version)
            sender.landed()         # until every receiver has taken the last bucket (send returns before)
            if version:
                seconds[t].append(time.perf_counter() - start)
    remapped = [report.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    for s in senders.values():
        s.close()

    params = [torch.empty_like(tensor) for _, tensor in tensors]
    floor = []
    for _ in range(args.pushes):
        start = time.perf_counter()
        for param, (_, tensor) in zip(params, tensors):
            param.copy_(tensor)
        floor.append(time.perf_counter() - start)

    mb = nbytes / 2**20
    print(f"{mb:.0f} MB in {len(tensors)} tensors, buckets of {args.bucket_mb:g} MB, {args.receivers} receiver(s), "
          f"median of {args.pushes} pushes; slots mapped afresh: {remapped}")
    median = {t: statistics.median(s) for t, s in seconds.items()}
    for t in TRANSPORTS:
        print(f"{t:<12} {median[t]:7.3f} s  {mb / median[t]:8.0f} MB/s")
    print(f"{'copy floor':<12} {statistics.median(floor):7.3f} s  {mb / statistics.median(floor):8.0f} MB/s")
    print(f"push shm/collectives {median['collectives'] / median['shm']:.1f}x")


if __name__ == "__main__":
    main()
