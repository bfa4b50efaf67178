"""Checkpoint save time against a plain write of the same bytes, on a ~100M-parameter Qwen3-shaped actor.

    python bench/checkpoint_save.py [--layouts tp1,tp2,dp2] [--repeats 3] [--smoke]

For each layout (torchrun, one process per rank, gloo) every rank builds its Megatron shard with its distributed
Adam optimizer, takes one update (so the optimizer has its moments), then alternates ``--repeats`` times:
``rlcore.megatron.checkpoint.save_model`` (megatron-core distributed checkpointing, torch_dist, fsync'd) into a fresh
directory, synchronously (``sync``: trainer.checkpoint_async=false) and asynchronously (the default: the seconds
until training could go on, ``async stall``, and until the write is finalized); and the floor: the same rank writing
the same tensors (its model shard's parameters and its optimizer state) as raw bytes into one file with an fsync.
Prints seconds (median, after barriers: the slowest rank), the bytes each wrote, and the ratios to the floor.
Goal: the asynchronous save stalls training no longer than the floor (ratio <= 1).
``--smoke`` (tests/integration/test_bench_smoke.py): the same path on a model of ~0.2M parameters (SMOKE_SHAPE), layout
tp2 unless ``--layouts`` is given, one repeat; the last line is then that layout's row, its ratios ``<x>x, <y>x``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from rlcore.launch import torchrun

SHAPE = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, ffn_hidden_size=2048,
             max_position_embeddings=256)
VOCAB = 32000
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   max_position_embeddings=64, vocab_size=512)     # --smoke's
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 2), "dp2": (2, 1)}   # world, tp


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def plain_write(tensors, path: str) -> int:
    import torch

    written = 0
    with open(path, "wb") as f:
        for t in tensors:
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            written += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return written


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from rlcore.config.schema import ActorConfig, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import save_model
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS

    torch.set_num_threads(1)
    hf = QWEN3.tiny_hf_config(**SMOKE_SHAPE) if args.smoke else QWEN3.tiny_hf_config(vocab_size=VOCAB, **SHAPE)
    actor = MegatronActor(QWEN3, hf, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-4),
                                                 parallel=ParallelConfig(tp=args.tp)), SPECS[0])
    batch = Batch(build_sequences([[1, 2, 3]] * 2, [[4, 5, 6, 7]] * 2, pad_id=0))
    actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 2), {}))
    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    mine = [p for p in actor.model.parameters()] + [t for o in inner for s in o.state.values() for t in s.values()
                                                     if torch.is_tensor(t) and t.dim() > 0]
    rank = dist.get_rank()
    pending = AsyncCallsQueue()
    saves, stalls, async_totals = [], [], []
    floors, floor_bytes, save_bytes = [], 0, 0
    for i in range(args.repeats):     # each output removed before the next write: no writeback left over
        start = time.perf_counter()
        floor_bytes = plain_write(mine, os.path.join(args.dir, f"floor.rank{rank}"))
        dist.barrier()
        floors.append(time.perf_counter() - start)
        os.remove(os.path.join(args.dir, f"floor.rank{rank}"))
        target = os.path.join(args.dir, "sync")
        dist.barrier()
        start = time.perf_counter()
        save_model(actor, target)
        dist.barrier()
        saves.append(time.perf_counter() - start)
        if rank == 0:
            save_bytes = directory_bytes(target)
            shutil.rmtree(target)
        target = os.path.join(args.dir, "async")
        dist.barrier()
        start = time.perf_counter()
        save_model(actor, target, pending)
        stall = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        stalls.append(stall.item())
        pending.maybe_finalize_async_calls(blocking=True)
        dist.barrier()
        async_totals.append(time.perf_counter() - start)
        if rank == 0:
            shutil.rmtree(target)
    total_floor = torch.tensor([float(floor_bytes)])
    dist.all_reduce(total_floor)
    if rank == 0:
        print(json.dumps({"save_s": statistics.median(saves), "floor_s": statistics.median(floors),
                          "stall_s": statistics.median(stalls), "async_s": statistics.median(async_totals),
                          "save_bytes": save_bytes,
                          "floor_bytes": int(total_floor.item()),
                          "parameters": sum(p.numel() for p in actor.model.parameters()) * args.tp}), flush=True)
    del actor
    shutdown_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", help="default: tp1,tp2,dp2 (--smoke: tp2)")
    parser.add_argument("--repeats", type=int, help="default: 3 (--smoke: 1)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat: a check that it runs")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    layouts = args.layouts or ("tp2" if args.smoke else "tp1,tp2,dp2")
    repeats = args.repeats or (1 if args.smoke else 3)
    print(f"{'layout':<8} {'params':>7} {'floor s':>8} {'sync s':>7} {'async stall s':>14} {'async total s':>14} "
          f"{'save MB':>8} {'floor MB':>9}   ratios to the floor: sync, async stall")
    for name in layouts.split(","):
        world, tp = LAYOUTS[name]
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            cmd = [*torchrun(world), __file__, "--rank", f"--tp={tp}", f"--dir={tmp}", f"--repeats={repeats}",
                   *(["--smoke"] if args.smoke else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode != 0:
                errors = [line for line in out.stderr.splitlines() if "Error" in line and "error_file" not in line]
                sys.exit("\n".join(errors[-20:]) + "\n" + out.stderr[-2000:])
            r = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        print(f"{name:<8} {r['parameters'] / 1e6:>6.0f}M {r['floor_s']:>8.2f} {r['save_s']:>7.2f} "
              f"{r['stall_s']:>14.2f} {r['async_s']:>14.2f} {r['save_bytes'] / 1e6:>8.0f} "
              f"{r['floor_bytes'] / 1e6:>9.0f}"
              f"   {r['save_s'] / r['floor_s']:.1f}x, {r['stall_s'] / r['floor_s']:.2f}x")


if __name__ == "__main__":
    main()
