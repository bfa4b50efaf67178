"""Training passes on long-tailed response lengths: fixed-size micro-batches against the token budget, with and
without packing the sequences into one row, and the memory recompute saves.

    python bench/long_responses.py [--sequences 32] [--max-len 1024] [--budget 4096] [--micro-batch 4] [--repeats 2]
                                   [--chunk 512] [--smoke]

A GRPO-shaped update (one process, a Qwen3-shaped actor, fp32): ``--sequences`` rows, prompts of 32 tokens,
responses drawn from a long-tailed (Pareto) law between 16 and ``--max-len`` tokens. Each configuration runs in its
own process (peak memory is the process's maximum resident set): ``fixed`` (``micro_batch_size`` rows padded to the
batch's longest), ``budget`` (``max_tokens_per_micro_batch``), ``packed`` (the budget in tokens, each micro-batch's
sequences end to end in one row: ``pack_sequences``), ``budget+full`` (the budget with full activation
recompute) and ``budget+whole`` (the budget with the output layer and logprobs on all of a micro-batch's tokens at
once; the others take ``--chunk`` tokens at a time: ``logprob_chunk_tokens``). Prints trained (response) tokens per
second over ``--repeats`` updates after a warm-up one, the padding fraction (the update's ``actor/padding_frac``:
padded positions of all positions the passes computed), the peak resident memory, and the ratios to fixed. Goal
(issue 16): >= 1.6x the fixed-size throughput at no higher peak memory.
Last line: ``logits <chunk> tokens at a time: <m> MB less peak memory than all at once, <x>x its throughput``.
``--smoke`` (tests/integration/test_bench_smoke.py): every configuration on 4 sequences of at most 64 tokens, a 2-layer
model (SMOKE_SHAPE), one timed update, all in this process one after another (a process each costs ~10 s of imports), so
its peak memory is the process's so far and its memory ratios mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from rlcore.launch import free_port

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, ffn_hidden_size=768)
VOCAB = 4096
SMOKE_SHAPE = dict(SHAPE, hidden_size=64, num_layers=2, head_dim=16, ffn_hidden_size=128)     # --smoke's
SMOKE = dict(sequences=4, max_len=64, budget=128, micro_batch=2, repeats=1, chunk=32)
CONFIGS = {"fixed": dict(recompute="none", budget=False, pack=False, chunked=True),
           "budget": dict(recompute="none", budget=True, pack=False, chunked=True),
           "packed": dict(recompute="none", budget=True, pack=True, chunked=True),
           "budget+full": dict(recompute="full", budget=True, pack=False, chunked=True),
           "budget+whole": dict(recompute="none", budget=True, pack=False, chunked=False)}


def response_lengths(n: int, longest: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(longest, int(16 * rng.paretovariate(0.7)))) for _ in range(n)]


def run_config(name: str, args) -> dict:
    """One configuration's warm-up and timed updates, in this process; what it measured."""
    import resource

    import torch

    from rlcore.config.schema import ActorConfig, OptimConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS

    torch.set_num_threads(1)
    config = CONFIGS[name]
    lengths = response_lengths(args.sequences, args.max_len)
    hf = QWEN3.tiny_hf_config(vocab_size=VOCAB, max_position_embeddings=32 + args.max_len,
                              **(SMOKE_SHAPE if args.smoke else SHAPE))
    cfg = ActorConfig(micro_batch_size=args.micro_batch, optim=OptimConfig(lr=1e-5), recompute=config["recompute"],
                      max_tokens_per_micro_batch=args.budget if config["budget"] else 0,
                      pack_sequences=config["pack"], logprob_chunk_tokens=args.chunk if config["chunked"] else 0)
    actor = MegatronActor(QWEN3, hf, cfg, SPECS[0])
    g = torch.Generator().manual_seed(0)
    batch = Batch(build_sequences([torch.randint(1, VOCAB, (32,), generator=g).tolist() for _ in lengths],
                                  [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths], pad_id=0))
    tokens = float(batch["response_mask"].sum())
    micro, _ = actor._micro_batches(batch)

    def update() -> dict:
        return actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", tokens,
                                                                 len(batch)), {}))

    padding = update()["actor/padding_frac"]      # warm-up: the optimizer's state, allocator
    start = time.perf_counter()
    for _ in range(args.repeats):
        update()
    seconds = (time.perf_counter() - start) / args.repeats
    del actor
    shutdown_parallel()
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "padding": padding, "micro_batches": len(micro),
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_in_process(name: str, args) -> dict:
    """``name`` in a process of its own (its peak memory its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, __file__, f"--config={name}", *sys.argv[1:]], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        sys.exit(out.stderr[-3000:])
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, all in this process: a check that it runs")
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)              # a world of one, no rendezvous
    if args.config:
        print(json.dumps(run_config(args.config, args)), flush=True)
        return
    lengths = response_lengths(args.sequences, args.max_len)
    print(f"{args.sequences} sequences, responses {min(lengths)}-{max(lengths)} tokens (mean "
          f"{sum(lengths) / len(lengths):.0f}), micro_batch_size={args.micro_batch}, "
          f"max_tokens_per_micro_batch={args.budget}")
    print(f"{'config':<12} {'tokens/s':>9} {'s/update':>9} {'padding':>8} {'micro-batches':>14} {'peak MB':>8}")
    results = {}
    for name in CONFIGS:
        r = results[name] = run_config(name, args) if args.smoke else run_in_process(name, args)
        print(f"{name:<12} {r['tokens_per_s']:>9.0f} {r['seconds']:>9.2f} {r['padding']:>8.1%} "
              f"{r['micro_batches']:>14} {r['peak_mb']:>8.0f}")
    fixed, budget, recompute = results["fixed"], results["budget"], results["budget+full"]
    for name in ("budget", "packed"):
        print(f"{name} / fixed: {results[name]['tokens_per_s'] / fixed['tokens_per_s']:.2f}x throughput, "
              f"{results[name]['peak_mb'] / fixed['peak_mb']:.2f}x peak memory (goal: >= 1.6x at <= 1.0x)")
    print(f"packed / budget: {results['packed']['tokens_per_s'] / budget['tokens_per_s']:.2f}x throughput; "
          f"full recompute: {budget['peak_mb'] - recompute['peak_mb']:.0f} MB less peak memory, "
          f"{recompute['tokens_per_s'] / budget['tokens_per_s']:.2f}x the budget's throughput")
    whole = results["budget+whole"]
    print(f"logits {args.chunk} tokens at a time: {whole['peak_mb'] - budget['peak_mb']:.0f} MB less peak memory "
          f"than all at once, {budget['tokens_per_s'] / whole['tokens_per_s']:.2f}x its throughput")


if __name__ == "__main__":
    main()
