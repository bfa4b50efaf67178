"""Weight sync train -> rollout on a ~0.5B-parameter Qwen3-shaped model (random weights), at several layouts.

    python bench/weight_sync.py [--backend vllm,sglang] [--layouts tp1,tp2,pp2] [--bucket-mb 256] [--dtype float32]
                                [--smoke]

For each backend and layout (torchrun, one process per rank, gloo) every rank hosts a Megatron shard and a rollout
engine (rollout TP=1: vLLM in the process through its external launcher, SGLang in its own scheduler process).
After one warm-up sync, ``--repeats`` timed syncs alternate with the engine floor: the engine ingesting the same full
HF tensors already in memory (``update_weights`` with no conversion or communication), so that drift on a busy
machine hits both alike. "sync/ingest" is the median of those paired ratios, on the worst rank. Goal: sync <= 1.3x the
engine floor.

Columns: seconds per sync (median) with the default transport (shared memory between ranks on one host);
"producer s", the part of it spent producing tensors (assembling and converting buckets, waiting for the other
ranks) rather than in the engine; "gloo s", the same sync over gloo broadcasts, as a peer; bytes moved into each
engine; calls per sync (collectives, or with shared memory the barriers and slot checks); buckets; "remaps":
shared-memory slots mapped afresh during the timed syncs (all ranks) because the engine still referenced them;
"shm MB": the two shared-memory slots, mapped once and shared by the host's ranks; "peak extra MB", the
resident-memory rise during a sync; "engine own MB", the rise during the engine floor (the engine's own
re-materialisation; the sync's own extra memory is roughly the difference); the largest bucket plus the largest
tensor; "copy s", a plain copy of the model's HF tensors into preallocated buffers (the other floor). Last line:
``worst sync/ingest <x>x (<backend> <layout>)``; a layout that failed makes the exit status 1.
``--smoke`` (tests/integration/test_bench_smoke.py): a model of ~0.1M parameters (SMOKE_SHAPE) in buckets of 0.25 MB,
one repeat, vLLM at tp2 unless ``--backend``/``--layouts`` are given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from rlcore.launch import torchrun

SHAPE = dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, ffn_hidden_size=3072,
             max_position_embeddings=256)
VOCAB = 32000
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   max_position_embeddings=256)      # --smoke's, with vocabulary SMOKE_VOCAB
SMOKE_VOCAB = 512
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "tp2xpp2": (4, 2, 2)}   # world, tp, pp


def make_checkpoint(directory: str, dtype: str, shape: dict = SHAPE, vocab: int = VOCAB) -> None:
    """Random HF Qwen3 checkpoint of ``shape`` (no model init: tensors are filled directly, std 0.02), with the
    arithmetic task's character tokenizer (its ids are the lowest of ``vocab``)."""
    import torch
    from safetensors.torch import save_file

    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    hf = QWEN3.tiny_hf_config(vocab_size=vocab, **shape)
    hf["dtype"] = dtype
    write_char_tokenizer(directory)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Qwen3ForCausalLM(Qwen3Config(**hf)).named_parameters()}
    g = torch.Generator().manual_seed(0)
    tdtype = getattr(torch, dtype)
    state = {n: (torch.ones(s) if "norm" in n else torch.randn(s, generator=g) * 0.02).to(tdtype)
             for n, s in shapes.items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)


class PeakRss:
    """Samples this process's resident memory in a thread; ``peak - start`` is the extra memory of a phase."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.start = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.start


def rank_main(args) -> None:
    """One rank of one layout (under torchrun)."""
    import torch

    torch.set_num_threads(1)
    from rlcore.config import load_config
    from rlcore.megatron.reshard import Resharder
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel
    from rlcore.plugins import load_plugins
    from rlcore_model_qwen3.plugin import QWEN3

    world, tp, pp = LAYOUTS[args.layout]
    init_parallel(tp, pp, seed=0)
    hf_config = read_hf_config(args.ckpt)
    model, converter = build_gpt(QWEN3, hf_config, args.dtype)
    load_hf_into(model, converter, read_hf_weights(args.ckpt))
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    resharder = Resharder(model, converter, bucket_bytes)                          # auto: shared memory on one host
    peer = Resharder(model, converter, bucket_bytes, transport="collectives") if world > 1 else None
    cfg = load_config("quickstart", ["rollout.kv_cache_gib=0.25"]).rollout
    backend = load_plugins([args.backend]).registry.get("rollout_backends", args.backend)
    rollout = backend.factory(args.ckpt, cfg, max_model_len=256, distributed=world > 1)
    counted = {}

    def counting(stream):
        """Counts the bytes, and the seconds spent producing them (assembling and converting buckets, waiting for
        the other ranks) as opposed to the engine's own ingest."""
        counted["bytes"], counted["producer_s"] = 0, 0.0
        while True:
            start = time.perf_counter()
            item = next(stream, None)
            counted["producer_s"] += time.perf_counter() - start
            if item is None:
                return
            counted["bytes"] += item[1].numel() * item[1].element_size()
            yield item

    def timed(push) -> tuple[float, int]:
        """Seconds of one push, and the resident-memory rise during it."""
        torch.distributed.barrier()
        with PeakRss() as mem:
            start = time.perf_counter()
            push()
            seconds = time.perf_counter() - start
        return seconds, mem.extra

    rollout.update_weights(resharder.stream(), 0)   # warm-up: the first load into a fresh engine is 2-3x slower
    full = [(n, t.clone()) for n, t in resharder.stream()]       # the same tensors, fully in memory
    largest = max(t.numel() * t.element_size() for _, t in full)
    dest = [torch.empty_like(t) for _, t in full]
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        for d, (_, t) in zip(dest, full):
            d.copy_(t)
        copies.append(time.perf_counter() - start)
    del dest
    exchange = resharder.exchange
    remapped_before = getattr(exchange, "remapped", 0)
    syncs, peaks, producing, ingests, ingest_peaks = [], [], [], [], []
    for _ in range(args.repeats):   # interleaved, so that drift on a busy machine hits the sync and its floor alike
        seconds, peak = timed(lambda: rollout.update_weights(counting(resharder.stream()), 0))
        syncs.append(seconds)
        peaks.append(peak)
        producing.append(counted["producer_s"])
        seconds, peak = timed(lambda: rollout.update_weights(iter(full), 0))
        ingests.append(seconds)
        ingest_peaks.append(peak)
    collectives = resharder.counters.collectives
    remaps = getattr(exchange, "remapped", 0) - remapped_before
    slots_bytes = sum(s.numel() for s in getattr(exchange, "slots", []))
    peer_s = statistics.median(timed(lambda: rollout.update_weights(peer.stream(), 0))[0] for _ in range(2)) \
        if peer else float("nan")
    result = dict(rank=torch.distributed.get_rank(), sync_s=statistics.median(syncs), peer_s=peer_s,
                  bytes=counted["bytes"], collectives=collectives, buckets=len(resharder.buckets),
                  peak_extra_bytes=max(peaks), remaps=remaps, slots_bytes=slots_bytes,
                  producer_s=statistics.median(producing), ingest_peak_extra_bytes=max(ingest_peaks),
                  bucket_bytes=resharder.counters.peak_bucket_bytes, largest_tensor_bytes=largest,
                  copy_s=min(copies), ingest_s=statistics.median(ingests),
                  ratio=statistics.median(s / i for s, i in zip(syncs, ingests)))
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    rollout.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="rollout backends, comma-separated, in one run (default: vllm,sglang; "
                                          "--smoke: vllm)")
    parser.add_argument("--layouts", help="default: tp1,tp2,pp2 (--smoke: tp2)")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs, each followed by its engine floor")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat: a check that it runs")
    parser.add_argument("--rank-of", dest="layout", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        rank_main(args)
        return 0
    if args.smoke:
        args.bucket_mb, args.repeats = 0.25, 1
    backends = args.backend or ("vllm" if args.smoke else "vllm,sglang")
    layouts = args.layouts or ("tp2" if args.smoke else "tp1,tp2,pp2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(dir="/tmp") as ckpt:
        make_checkpoint(ckpt, args.dtype, *((SMOKE_SHAPE, SMOKE_VOCAB) if args.smoke else (SHAPE, VOCAB)))
        params, failed, worst_ratio = None, [], None
        columns = ["backend", "layout", "sync s", "producer s", "gloo s", "MB moved", "collectives", "buckets",
                   "remaps", "shm MB", "peak extra MB", "engine own MB", "bucket+largest MB", "copy s", "ingest s",
                   "sync/ingest", "sync/copy"]
        print(" ".join(f"{c:>{max(len(c), 7)}}" for c in columns))
        for backend, layout in [(b, lay) for lay in layouts.split(",") for b in backends.split(",")]:
            world = LAYOUTS[layout][0]
            with tempfile.TemporaryDirectory() as out:
                cmd = [*torchrun(world), __file__, "--rank-of", layout, "--ckpt", ckpt, "--out", out,
                       "--bucket-mb", str(args.bucket_mb), "--dtype", args.dtype, "--repeats", str(args.repeats),
                       "--backend", backend]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{backend} {layout}: failed\n{proc.stderr[-3000:]}")
                    failed.append(f"{backend} {layout}")
                    continue
                ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
            worst = max(ranks, key=lambda r: r["ratio"])
            if worst_ratio is None or worst["ratio"] > worst_ratio[0]:
                worst_ratio = (worst["ratio"], backend, layout)
            params = worst["bytes"] // (4 if args.dtype == "float32" else 2)
            mb = 1 << 20
            row = [backend, layout, f"{worst['sync_s']:.2f}", f"{worst['producer_s']:.2f}", f"{worst['peer_s']:.2f}",
                   f"{worst['bytes'] / mb:.0f}",
                   worst["collectives"], worst["buckets"], sum(r["remaps"] for r in ranks),
                   f"{worst['slots_bytes'] / mb:.0f}", f"{max(r['peak_extra_bytes'] for r in ranks) / mb:.0f}",
                   f"{max(r['ingest_peak_extra_bytes'] for r in ranks) / mb:.0f}",
                   f"{(worst['bucket_bytes'] + worst['largest_tensor_bytes']) / mb:.0f}", f"{worst['copy_s']:.2f}",
                   f"{worst['ingest_s']:.2f}", f"{worst['ratio']:.2f}",
                   f"{worst['sync_s'] / worst['copy_s']:.1f}"]
            print(" ".join(f"{v:>{max(len(c), 7)}}" for c, v in zip(columns, row)))
        if params:
            print(f"model: {params / 1e6:.0f}M parameters ({args.dtype}), bucket {args.bucket_mb} MB, "
                  "rollout TP=1 per rank")
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    print(f"worst sync/ingest {worst_ratio[0]:.2f}x ({worst_ratio[1]} {worst_ratio[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
