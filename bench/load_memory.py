"""Peak host memory per rank while a checkpoint loads into the actor's Megatron shard, and while the actor exports
an HF checkpoint, against the bound each should keep.

    python bench/load_memory.py [--layouts world1,tp2,pp2,ep2] [--models dense,moe] [--max-shard-mb 256] [--smoke]

Writes two bf16 checkpoints in HF's sharded layout (>= 4 files with an index): a Qwen3-shaped dense model of ~0.52B
parameters and a Qwen3-MoE-shaped one of ~0.25B (32 experts a layer). For each layout (torchrun, one process per
rank, gloo) every rank resets its peak resident-set size (/proc/self/clear_refs), builds its shard and loads it
(``build_gpt`` + ``load_hf_into``, what the actor, the critic and the reference do before Megatron DDP and the
optimizer are built on top), and reports the peak rise over its resident size before the build, divided by the
bound: that rank's parameter bytes + the largest single tensor of the checkpoint. Then the export: rank 0 writes
the HF checkpoint from the weight stream (``MegatronActor.save_hf``'s path) in files of ``--max-shard-mb``; its
peak rise over the bound max_shard_size + largest tensor. ``baseline`` runs the code before this benchmark's
change in the same processes' place: every file read whole by every rank (``safetensors.torch.load_file``), every
converted tensor held until all are copied, and the export collected into one dict written as one file.
Goal: ratios <= 1.3 at every layout. Last line: ``worst load ratio <x>, worst export ratio <y>`` (the new code's).
``--smoke`` (tests/integration/test_bench_smoke.py): the same path on a MoE model of a few hundred kB (SMOKE) in several
files, at world1 (a 2-rank layout costs 20 s more), export files of 1 MB (``--models``/``--layouts`` still choose); its
ratios mean nothing (the bounds are dominated by the 1 MB file size).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from process_memory import reset_peak, status   # bench/process_memory.py

from rlcore.launch import torchrun

MODELS = {
    "dense": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=32000, hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64),
    "moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=32000, hidden_size=512,
                intermediate_size=1536, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
}
COMMON = dict(max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", attention_bias=False, dtype="bfloat16", bos_token_id=0, eos_token_id=0)
SMOKE = {"dense": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16),
         "moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16)}       # --smoke's shapes, over MODELS'
FAMILY = {"dense": ("qwen3", "qwen3"), "moe": ("qwen3", "qwen3_moe")}      # plugin, model family
LAYOUTS = {"world1": dict(world=1), "tp2": dict(world=2, tp=2), "pp2": dict(world=2, pp=2),
           "ep2": dict(world=2, ep=2)}


def write_checkpoint(model: str, path: str, file_bytes: int, smoke: bool = False) -> int:
    """Random bf16 weights of ``model``'s shapes (``smoke``: SMOKE's), written tensor by tensor in files of
    ``file_bytes``; returns the largest tensor's bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.hf_checkpoint import TensorSpec, write_sharded

    config = {**MODELS[model], **(SMOKE[model] if smoke else {}), **COMMON}
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    specs = []
    for name, p in meta.state_dict().items():
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name and p.dim() == 3:
            # transformers 5 keeps experts fused in memory and writes them per expert
            for e in range(p.shape[0]):
                if name.endswith("gate_up_proj"):
                    half = p.shape[1] // 2
                    specs += [TensorSpec(name.replace("experts.gate_up_proj", f"experts.{e}.{w}.weight"),
                                         (half, p.shape[2]), torch.bfloat16) for w in ("gate_proj", "up_proj")]
                else:
                    specs.append(TensorSpec(name.replace("experts.down_proj", f"experts.{e}.down_proj.weight"),
                                            tuple(p.shape[1:]), torch.bfloat16))
        else:
            specs.append(TensorSpec(name, tuple(p.shape), torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    tensors = ((s.name, (torch.randn(s.shape, generator=g) * 0.02).to(torch.bfloat16)) for s in specs)
    write_sharded(path, specs, tensors, file_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return max(s.nbytes for s in specs)


def _baseline_load(model, converter, path: str) -> None:
    """The loading code before the lazy reader: every file whole, every converted tensor kept until all are
    copied."""
    import torch
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file

    from rlcore.megatron.names import global_name, is_expert, named_weights

    state = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, f)))
    params = {global_name(model, n): p for n, p in named_weights(model, converter)}
    experts = {n: p for n, p in params.items() if is_expert(p)}
    dense = {n: p for n, p in params.items() if n not in experts}
    tensors = [*converter.megatron_from_hf(state, dense.items(), mpu.get_tensor_model_parallel_rank(),
                                           mpu.get_tensor_model_parallel_world_size()),
               *converter.megatron_from_hf(state, experts.items())]
    with torch.no_grad():
        for name, value in tensors:
            params[name].copy_(value)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    from rlcore.megatron.reshard import Resharder
    from rlcore.hf_checkpoint import HFCheckpoint, TensorSpec, write_sharded
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config
    from rlcore.megatron.parallel import init_parallel, shutdown_parallel
    from rlcore.plugins import load_plugins

    plugin, family = FAMILY[args.model]
    spec = load_plugins([plugin]).registry.get("models", family)
    hf_config = read_hf_config(args.ckpt)
    init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, seed=0)
    rank = dist.get_rank()
    before = reset_peak()
    model, converter = build_gpt(spec, hf_config, "bfloat16")
    if args.baseline:
        _baseline_load(model, converter, args.ckpt)
    else:
        load_hf_into(model, converter, HFCheckpoint(args.ckpt))
    load_rise = status("VmHWM") - before
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    resharder = Resharder(model, converter, bucket_bytes=args.bucket_mb << 20)
    dist.barrier()
    before = reset_peak()
    out = os.path.join(args.out, "export")
    if rank == 0:
        if args.baseline:      # the old save_hf: one dict of every tensor, one file
            os.makedirs(out, exist_ok=True)
            save_file({n: t.contiguous().clone() for n, t in resharder.stream()},
                      os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        else:
            specs = [TensorSpec(n, s, e.dtype) for b in resharder.buckets for e in b.entries for n, s in e.hf]
            write_sharded(out, specs, resharder.stream(), args.max_shard_mb << 20)
    else:
        for _ in resharder.stream():
            pass
    export_rise = status("VmHWM") - before
    dist.barrier()
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dict(rank=rank, load_rise=load_rise, param_bytes=param_bytes,
                                      export_rise=export_rise))
    if rank == 0:
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        print(json.dumps({"ranks": rows, "export_files": len(files)}), flush=True)
    del model, converter, resharder
    shutdown_parallel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", help="default: world1,tp2,pp2,ep2 (--smoke: world1)")
    parser.add_argument("--models", help="default: dense,moe (--smoke: moe)")
    parser.add_argument("--max-shard-mb", type=int, default=256, help="export files of at most this many MB")
    parser.add_argument("--bucket-mb", type=int, default=64, help="weight-stream buckets (rollout.sync_bucket_mb)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, export files of 1 MB: a check that it runs")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    for key in ("tp", "pp", "ep"):
        parser.add_argument(f"--{key}", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    if args.smoke:
        args.max_shard_mb = 1
    layouts = args.layouts or ("world1" if args.smoke else "world1,tp2,pp2,ep2")
    models = args.models or ("moe" if args.smoke else "dense,moe")
    worst_load = worst_export = 0.0
    print(f"{'model':<6} {'layout':<7} {'rank':>4} {'shard MB':>9} {'load rise MB':>13} {'load ratio':>11} "
          f"{'export rise MB':>15} {'export ratio':>13}   (baseline: load ratio, export ratio)")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for model in models.split(","):
            ckpt = os.path.join(tmp, model)
            file_bytes = 64 << 10 if args.smoke else 300 << 20 if model == "dense" else 120 << 20
            largest = write_checkpoint(model, ckpt, file_bytes, args.smoke)
            files = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
            print(f"# {model}: {files} files, largest tensor {largest / 1e6:.0f} MB")
            for layout in layouts.split(","):
                sizes = LAYOUTS[layout]
                if sizes.get("ep", 1) > 1 and model == "dense":
                    continue
                results = {}
                for baseline in (False, True):
                    out = os.path.join(tmp, "out")
                    cmd = [*torchrun(sizes["world"]), __file__, "--rank", f"--model={model}", f"--ckpt={ckpt}",
                           f"--out={out}", f"--max-shard-mb={args.max_shard_mb}", f"--bucket-mb={args.bucket_mb}",
                           *[f"--{k}={sizes.get(k, 1)}" for k in ("tp", "pp", "ep")]]
                    run = subprocess.run(cmd + (["--baseline"] if baseline else []), capture_output=True, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
                    if run.returncode != 0:
                        sys.exit(run.stderr[-3000:])
                    results[baseline] = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("{")][-1])
                    subprocess.run(["rm", "-rf", out])
                for new, old in zip(results[False]["ranks"], results[True]["ranks"]):
                    load_bound = new["param_bytes"] + largest
                    export_bound = (args.max_shard_mb << 20) + largest
                    load_ratio, export_ratio = new["load_rise"] / load_bound, new["export_rise"] / export_bound
                    worst_load, worst_export = max(worst_load, load_ratio), max(worst_export, export_ratio)
                    print(f"{model:<6} {layout:<7} {new['rank']:>4} {new['param_bytes'] / 1e6:>9.0f} "
                          f"{new['load_rise'] / 1e6:>13.0f} {load_ratio:>11.2f} {new['export_rise'] / 1e6:>15.0f} "
                          f"{export_ratio:>13.2f}   ({old['load_rise'] / load_bound:.2f}, "
                          f"{old['export_rise'] / export_bound:.2f})", flush=True)
    print(f"worst load ratio {worst_load:.2f}, worst export ratio {worst_export:.2f}")


if __name__ == "__main__":
    main()
