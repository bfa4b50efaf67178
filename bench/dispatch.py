"""Handing a step's batch to two Ray workers and a per-token result back, against a plain copy of the same bytes.

    python bench/dispatch.py [--rows 1024] [--seq 2048] [--layouts dp2,tp2] [--repeats 7] [--smoke]

Two Ray workers behind the real ``ActorGroup`` (``rlcore.workers.echo.EchoWorker``: no model; its "forward" is one
multiply, so what is timed is the dispatch). ``dp2``: each worker its own data-parallel share; ``tp2``: the two are
TP peers reading one share and the first reports. The batch is what a GRPO step holds at its update, ``--rows`` x
``--seq`` tokens (2.1M by default): input_ids, response_mask, rollout/old/ref logprobs and advantages per token;
lengths, rewards and group ids per row; one metadata dict per row. Each repeat times ``ActorGroup.logprobs`` (the
shares out, every worker's pass, the per-token result back in the batch's row order) two ways, alternating:

- ``before``: the dispatch before issue 24, reproduced here: each rank's share passed by value (Ray serialises it
  again for every rank, torch tensors through ``torch.save``) and every rank's result sent back;
- ``now``: the group as it is: one object-store put per share, its bytes out of band, only reporting ranks answer.

The floor: one ``copy_`` of the batch's and the result's bytes into buffers already allocated, in this process.
Prints medians in seconds and as ratios to the floor; the last line is the worst ``now`` ratio over the layouts.
``--smoke`` (tests/integration/test_bench_smoke.py): both layouts on a batch of 16 x 64 tokens, one repeat.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from rlcore.config import load_config  # noqa: E402
from rlcore.data import Batch  # noqa: E402
from rlcore.workers.echo import EchoWorker  # noqa: E402
from rlcore.workers.group import WorkerGroup, dp_parts, in_batch_order  # noqa: E402
from rlcore.workers.proxies import ActorGroup  # noqa: E402

LAYOUTS = {"dp2": 1, "tp2": 2}     # tp: ranks per data-parallel share, of 2 workers


class TorchPickled(Batch):
    """A ``Batch`` pickled as before issue 24: its attributes as they are, tensors through torch's own reducer."""
    __reduce__ = object.__reduce__


def step_batch(rows: int, seq: int) -> Batch:
    """A GRPO update's batch: prompts of 1/4 of ``seq``, responses filling the rest to varied lengths."""
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.full((rows,), seq // 4)
    response_len = torch.randint(seq // 8, seq - seq // 4 + 1, (rows,), generator=g)
    mask = ((torch.arange(seq) >= prompt_len[:, None] - 1)
            & (torch.arange(seq) < (prompt_len + response_len)[:, None] - 1)).float()
    per_token = {k: torch.randn(rows, seq, generator=g) * mask
                 for k in ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages")}
    return Batch({"input_ids": torch.randint(0, 151_936, (rows, seq), generator=g), "response_mask": mask,
                  "prompt_len": prompt_len, "response_len": response_len, "rewards": torch.rand(rows, generator=g),
                  "group_ids": torch.arange(rows) // 8, **per_token},
                 [{"index": i, "answer": str(i)} for i in range(rows)])


def before(group: WorkerGroup, batch: Batch) -> torch.Tensor:
    """``WorkerGroup.per_token`` before issue 24."""
    parts = dp_parts(batch, group.dp_size)
    shares = [TorchPickled(s.tensors, s.meta) for s in (batch.select(r) for r in parts)]
    results = group.call_each(EchoWorker.logprobs, [(shares[c.dp_rank], False) for c in group.coords])
    return in_batch_order(parts, group._reported(results))


def floor(batch: Batch, result: torch.Tensor) -> float:
    """Seconds for one plain copy of the batch's and the result's bytes (destinations allocated and touched)."""
    sources = [*batch.tensors.values(), result]
    targets = [torch.empty_like(t).copy_(t) for t in sources]
    start = time.perf_counter()
    for target, source in zip(targets, sources):
        target.copy_(source)
    return time.perf_counter() - start


def timed(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layouts", default="dp2,tp2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="16 rows x 64 tokens, one repeat: a check that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.seq, args.repeats = 16, 64, 1
    torch.set_num_threads(1)
    batch = step_batch(args.rows, args.seq)
    batch_mb = sum(t.nbytes for t in batch.tensors.values()) / 1e6
    print(f"batch: {args.rows} rows x {args.seq} tokens = {args.rows * args.seq / 1e6:.2f}M tokens, "
          f"{batch_mb:.0f} MB of tensors; result {args.rows * args.seq * 4 / 1e6:.0f} MB; 2 Ray workers, "
          f"median of {args.repeats}")
    print(f"{'layout':<7} {'floor s':>8} {'before s':>9} {'now s':>7} {'before/floor':>13} {'now/floor':>10} "
          f"{'before/now':>11}")
    worst = 0.0
    for name in args.layouts.split(","):
        cfg = load_config("quickstart", ["trainer.world_size=2", f"actor.parallel.tp={LAYOUTS[name]}"])
        group = ActorGroup(cfg, None, "", worker_cls=EchoWorker)
        try:
            expected = batch["old_logprobs"] * batch["response_mask"]
            seconds: dict[str, list[float]] = {"floor": [], "before": [], "now": []}
            ways = [("before", lambda: before(group, batch)), ("now", lambda: group.logprobs(batch))]
            for i in range(args.repeats + 1):              # the first round warms up, untimed
                for way, fn in ways if i % 2 else ways[::-1]:
                    s, out = timed(fn)
                    assert torch.equal(out, expected), way
                    if i:
                        seconds[way].append(s)
                if i:
                    seconds["floor"].append(floor(batch, expected))
        finally:
            group.stop()
        m = {k: statistics.median(v) for k, v in seconds.items()}
        worst = max(worst, m["now"] / m["floor"])
        print(f"{name:<7} {m['floor']:>8.3f} {m['before']:>9.3f} {m['now']:>7.3f} {m['before'] / m['floor']:>12.1f}x "
              f"{m['now'] / m['floor']:>9.1f}x {m['before'] / m['now']:>10.2f}x")
    print(f"worst dispatch ratio to the copy floor {worst:.1f}x ({batch_mb:.0f} MB batch, 2 workers)")


if __name__ == "__main__":
    main()
