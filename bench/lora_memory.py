"""What LoRA saves: optimizer state, gradient buffers, parameters and the reference policy per rank, LoRA against
full fine-tuning, on Qwen2.5-0.5B's published shape; and one weight sync, merged weights against adapters only.

    python bench/lora_memory.py [--rank 16] [--repeats 3] [--engine vllm|none] [--small | --smoke]

The model is configs/models/qwen2.5-0.5b.json (Qwen2.5-0.5B's config.json: hidden 896, 24 layers, 14 heads, 2 KV
heads, FFN 4864, vocabulary 151936, tied embeddings) with random weights built in-process (nothing downloaded);
``--small`` keeps its widths but 2 layers and a vocabulary of 8192 (a quick check of the script, ~1 min); ``--smoke``
(tests/integration/test_bench_smoke.py) is 2 layers of width 64 and a vocabulary of 512 (SMOKE), one repeat. Each arm
is its own process (one rank, TP1, gloo): rlcore's MegatronActor in bfloat16 with the run's optimizer (distributed
Adam), a GRPO config with a KL term (``algorithm.kl_coef``), so the actor freezes its reference policy as a run's
worker does; then one real update. *full*: every weight trained; *lora*: ``actor.lora.rank`` on linear_qkv,
linear_proj, linear_fc1 and linear_fc2, the base frozen.

Measured from the live objects after the update: optimizer state (Adam's two moments and the fp32 main copies of
the bf16 parameters, as megatron-core's distributed optimizer holds them), DDP's gradient buffers, the parameters
(DDP's parameter buffers and the frozen weights, which have none), and the reference policy: the bytes of the
reference model the actor holds (with LoRA none: the reference is the model with its adapters off) and the rise of
resident memory while it is frozen; the process's peak resident memory up to then (the sync's buffers below are
this benchmark's own). Printed beside ``rlcore run --dry-run``'s estimate for the same config
(``rlcore.sizing.estimate``).

Sync, ``--repeats`` times after the update (the median): the seconds to produce what the engine loads, and its
bytes. *full fine-tuning*: the resharder's stream of HF weights (``Resharder.stream``) in the full arm; *merged*:
the same stream in the LoRA arm, each adapted weight sent as W + B A * scale (what a LoRA run sends by default);
*adapters*: the adapters alone, as ``rollout.lora=adapters`` sends them (``rlcore.lora.sync.AdapterSync``:
gathered over the ranks, in PEFT's per-projection layout), alternating with *merged*. The engine's own load is not
part of this benchmark (bench/weight_sync.py measures vLLM's and SGLang's): every tensor a sync yields is copied into
a buffer allocated beforehand, as an engine copies into its parameters, so each pays for its bytes alike. With
``--engine vllm`` (the default) also whole syncs into a real vLLM engine started from the base weights, through the
run's own ``HybridEngine.sync_weights``: merged into an engine without LoRA, adapters into one with LoRA on (one
engine at a time, after a warm-up sync each).

Goal (issue 29): LoRA's optimizer state <= 5% of full fine-tuning's at rank 16. Last line:
``lora optimizer state <p>% of full``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from process_memory import resident, status   # bench/process_memory.py

MODEL_CONFIG = "qwen2.5-0.5b"            # configs/models/
SMALL = dict(num_hidden_layers=2, vocab_size=8192, max_window_layers=2)
SMOKE = dict(SMALL, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2)
SIZES = {"small": (SMALL, " --small (2 layers, vocabulary 8192)"),
         "smoke": (SMOKE, " --smoke (2 layers of width 64, vocabulary 512)")}     # over the model's config
MB = 1 << 20


def overrides(arm: str, rank: int) -> list[str]:
    """The run config both arms share; only actor.lora differs."""
    return ["model.family=qwen2", f"model.hf_config={MODEL_CONFIG}", "actor.dtype=bfloat16", "actor.micro_batch_size=2",
            "algorithm.name=grpo", "algorithm.kl_coef=0.001", f"actor.lora.rank={rank if arm == 'lora' else 0}"]


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def optimizer_state(actor) -> dict[str, int]:
    """Adam's moments, and the main parameters the optimizer steps that are not the model's own (the fp32 copies of
    bf16 parameters), of every optimizer the actor's chain holds."""
    import torch

    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    moments = [t for o in inner for state in o.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0]
    model_storages = {t.untyped_storage().data_ptr() for t in actor._memory("params") + actor._memory("grads")}
    main = [p for o in inner for group in o.param_groups for p in group["params"]
            if p.untyped_storage().data_ptr() not in model_storages]
    return dict(moments=_bytes(moments), main_params=_bytes(main))


def syncs(actor, repeats: int, lora: bool) -> dict[str, dict[str, float]]:
    """The weight syncs (full fine-tuning: the plain one; LoRA: merged and adapters-only alternating, so that drift
    on a busy machine hits both alike), ``repeats`` times: the median seconds, the bytes and tensors of one. A first
    pass of each sizes the buffers the tensors are copied into (and warms up)."""
    import statistics

    import torch

    streams = {"merged": actor.hf_weights}
    if lora:       # what rollout.lora=adapters sends: the whole adapter in PEFT's layout, gathered over the ranks
        from rlcore.lora.config import lora_config
        from rlcore.lora.sync import AdapterSync

        adapters = AdapterSync(actor.model, actor.converter, lora_config(actor.cfg.lora), None)
        streams["adapters"] = lambda: iter(adapters.tensors().items())
    destinations = {what: [torch.empty_like(t) for _, t in stream()] for what, stream in streams.items()}
    seconds: dict[str, list[float]] = {what: [] for what in streams}
    counted = {}
    for _ in range(repeats):
        for what, stream in streams.items():
            start = time.perf_counter()
            count, nbytes = 0, 0
            for (_, tensor), destination in zip(stream(), destinations[what], strict=True):
                destination.copy_(tensor)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
            seconds[what].append(time.perf_counter() - start)
            counted[what] = dict(bytes=nbytes, tensors=count)
    return {what: dict(counted[what], seconds=statistics.median(seconds[what])) for what in streams}


def engine_syncs(actor, registry, cfg, base: str, repeats: int) -> dict[str, dict[str, float]]:
    """Whole syncs into a real vLLM engine started from ``base`` (the base weights), through the run's own code
    (``HybridEngine.sync_weights``: its seconds, bytes and tensors): merged weights into an engine as a merged run
    starts it, then the adapters into one with LoRA on (``rollout.lora=adapters``), one engine at a time. Median of
    ``repeats`` after a warm-up sync (a fresh engine's first load is slower)."""
    import statistics

    from rlcore.lora.config import lora_config
    from rlcore.lora.sync import AdapterSync
    from rlcore.weight_sync.hybrid import HybridEngine

    backend = registry.get("rollout_backends", "vllm")
    results = {}
    for what in ("merged", "adapters"):
        lora = what == "adapters"
        engine = backend.factory(base, cfg.rollout, max_model_len=64, lora_rank=cfg.actor.lora.rank if lora else 0)
        adapters = AdapterSync(actor.model, actor.converter, lora_config(cfg.actor.lora), base) if lora else None
        hybrid = HybridEngine(actor, engine, adapters=adapters)
        stats = []
        for _ in range(repeats + 1):
            stats.append(hybrid.sync_weights())
        engine.stop()
        results[what] = dict(seconds=statistics.median(s.seconds for s in stats[1:]), bytes=stats[-1].bytes,
                             tensors=stats[-1].tensors)
    return results


def arm_main(arm: str, rank: int, size: str | None, repeats: int, engine: bool) -> dict:
    """One arm in this process: the actor, its reference, one update, what it holds."""
    import torch

    from rlcore.config import bind_plugin_section, load_config
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import transformer_config
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore.plugins import load_plugins
    from rlcore.sizing import estimate, read_model_config

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(arm, rank))
    registry = load_plugins().registry
    spec = registry.get("models", cfg.model.family)
    algorithm = registry.get("algorithms", cfg.algorithm["name"])
    needs_reference = algorithm.needs_reference(bind_plugin_section("algorithm", dict(cfg.algorithm),
                                                                    algorithm.config_cls))
    hf = read_model_config(cfg)
    if size:
        shrink = SIZES[size][0]
        hf.update(shrink, layer_types=hf["layer_types"][: shrink["num_hidden_layers"]])
    actor = MegatronActor(spec, hf, cfg.actor, registry.get("optimizers", cfg.actor.optim.name), seed=0)
    built = resident()
    base = tempfile.mkdtemp(prefix="lora-memory-base-")
    if engine and arm == "lora":   # the engine's base weights (B = 0: what the actor streams is the base exactly)
        from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

        actor.save_hf(base)
        write_char_tokenizer(base)
        built = resident()
    if not needs_reference:
        raise SystemExit(f"{cfg.algorithm['name']} with {dict(cfg.algorithm)} keeps no reference policy: the benchmark "
                         "needs a KL term (algorithm.kl_coef > 0)")
    actor.freeze_reference()       # as the run's worker does for a KL term
    reference_rise = resident() - built
    reference_bytes = _bytes(actor.reference.parameters()) if actor.reference is not None else 0

    g = torch.Generator().manual_seed(0)
    vocab = hf["vocab_size"]
    batch = Batch(build_sequences([torch.randint(1, vocab, (16,), generator=g).tolist() for _ in range(2)],
                                  [torch.randint(1, vocab, (16,), generator=g).tolist() for _ in range(2)], pad_id=0))
    batch.tensors["ref_logprobs"] = actor.logprobs(batch, reference=True)      # the reference policy's pass
    tokens = float(batch["response_mask"].sum())

    def loss(logp, mb):        # a policy-gradient term and the KL to the reference: both reach every trained weight
        kl = (logp - mb["ref_logprobs"]) ** 2
        return aggregate(-logp + 0.001 * kl, mb["response_mask"], "token-mean", tokens, len(batch)), {}

    start = time.perf_counter()
    actor.train_step(batch, loss)
    update_s = time.perf_counter() - start
    optimizer = optimizer_state(actor)
    measured = dict(params=_bytes(actor._memory("params")), grads=_bytes(actor._memory("grads")),
                    optimizer=optimizer["moments"] + optimizer["main_params"], **optimizer,
                    reference=reference_bytes, reference_rise=reference_rise,
                    trained=sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
                    total=sum(p.numel() for p in actor.model.parameters()),
                    update_s=update_s, reference_is_base=actor.reference_is_base)
    m = estimate(transformer_config(spec, hf, cfg.actor.dtype), hf, cfg, needs_reference)
    estimated = dict(m["per_device"], reference=m["reference"])
    peak = status("VmHWM")        # before the sync, whose destination buffers are this benchmark's own
    synced = syncs(actor, repeats, lora=arm == "lora")
    engine_synced = engine_syncs(actor, registry, cfg, base, repeats) if engine and arm == "lora" else {}
    shutil.rmtree(base)
    del actor
    shutdown_parallel()
    return dict(arm=arm, measured=measured, estimated=estimated, sync=synced, engine_sync=engine_synced,
                peak_rss=peak)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.3f}"


def report(results: dict[str, dict], rank: int, size: str | None) -> str:
    full, lora = results["full"], results["lora"]
    lines = [f"model: {MODEL_CONFIG}{SIZES[size][1] if size else ''}, bfloat16, one rank "
             f"(TP1), GRPO with a KL term; lora: rank {rank} on linear_qkv, linear_proj, linear_fc1, linear_fc2",
             f"trained parameters: full {full['measured']['trained']:,}, lora {lora['measured']['trained']:,} "
             f"({lora['measured']['trained'] / full['measured']['trained']:.2%}); the model "
             f"{full['measured']['total']:,}",
             "", f"{'GiB per rank':<28} {'full':>9} {'dry-run':>9} {'lora':>9} {'dry-run':>9} {'lora/full':>10}"]
    for key, label in (("optimizer", "optimizer state"), ("moments", "  Adam moments"),
                       ("main_params", "  fp32 main params"), ("grads", "gradient buffers"),
                       ("params", "parameters"), ("reference", "reference policy held"),
                       ("reference_rise", "  RSS rise freezing it")):
        f, lo = full["measured"][key], lora["measured"][key]
        est_f, est_l = full["estimated"].get(key), lora["estimated"].get(key)
        lines.append(f"{label:<28} {_gib(f):>9} {_gib(est_f) if est_f is not None else '':>9} {_gib(lo):>9} "
                     f"{_gib(est_l) if est_l is not None else '':>9} {lo / f if f else float('nan'):>10.2%}")
    lines += [f"{'peak RSS before the sync':<28} {_gib(full['peak_rss']):>9} {'':>9} {_gib(lora['peak_rss']):>9} "
              f"{'':>9} {lora['peak_rss'] / full['peak_rss']:>10.2%}",
              f"one update: full {full['measured']['update_s']:.1f} s, lora {lora['measured']['update_s']:.1f} s; "
              f"the reference policy: full a frozen copy, lora the model with its adapters off (reference_is_base="
              f"{lora['measured']['reference_is_base']})", ""]
    plain, merged, adapters = full["sync"]["merged"], lora["sync"]["merged"], lora["sync"]["adapters"]
    lines += ["weight sync after the update (median of --repeats; lora's alternating), produced and copied into "
              "buffers allocated before; the engine's own load not included (bench/weight_sync.py):",
              "  full fine-tuning: the resharder's stream (Resharder.stream), the full arm's model",
              "  merged: the same stream in the lora arm, each adapted weight as W + B A * scale",
              "  adapters only: what rollout.lora=adapters sends (AdapterSync.tensors: the adapters in PEFT's layout)",
              f"{'':<16} {'MB':>9} {'tensors':>8} {'s':>7}",
              f"full fine-tuning {plain['bytes'] / MB:>9.1f} {plain['tensors']:>8} {plain['seconds']:>7.3f}",
              f"merged           {merged['bytes'] / MB:>9.1f} {merged['tensors']:>8} {merged['seconds']:>7.3f}",
              f"adapters only    {adapters['bytes'] / MB:>9.1f} {adapters['tensors']:>8} {adapters['seconds']:>7.3f}",
              f"adapters / merged: {adapters['bytes'] / merged['bytes']:.2%} of the bytes, "
              f"{adapters['seconds'] / merged['seconds']:.2%} of the seconds; merged / full fine-tuning's: "
              f"{merged['seconds'] / plain['seconds']:.2f}x the seconds (the merges)", ""]
    if lora["engine_sync"]:
        merged, adapters = lora["engine_sync"]["merged"], lora["engine_sync"]["adapters"]
        lines += ["whole syncs into vLLM (HybridEngine.sync_weights, the engine's load included; rollout.lora=merged "
                  "into an engine without LoRA, rollout.lora=adapters into one with it)",
                  f"{'':<16} {'MB':>9} {'tensors':>8} {'s':>7}",
                  f"merged           {merged['bytes'] / MB:>9.1f} {merged['tensors']:>8} {merged['seconds']:>7.3f}",
                  f"adapters only    {adapters['bytes'] / MB:>9.1f} {adapters['tensors']:>8} "
                  f"{adapters['seconds']:>7.3f}",
                  f"adapters / merged: {adapters['bytes'] / merged['bytes']:.2%} of the bytes, "
                  f"{adapters['seconds'] / merged['seconds']:.2%} of the seconds", ""]
    share = lora["measured"]["optimizer"] / full["measured"]["optimizer"]
    lines.append(f"lora optimizer state {share * 100:.2f}% of full")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16, help="actor.lora.rank")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--small", action="store_true", help="2 layers, vocabulary 8192: a quick check")
    sizes.add_argument("--smoke", action="store_true", help="2 layers of width 64, vocabulary 512: a check that it "
                                                            "runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs of each kind (median)")
    parser.add_argument("--engine", choices=["vllm", "none"], default="vllm",
                        help="also time whole syncs into a vLLM engine (none: skip; the engine's start takes ~1 min)")
    parser.add_argument("--arm", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "smoke" if args.smoke else "small" if args.small else None
    if args.smoke:
        args.repeats = 1
    if args.arm:
        print(json.dumps(arm_main(args.arm, args.rank, size, args.repeats, args.engine == "vllm")),
              flush=True)
        return
    results = {}
    for arm in ("full", "lora"):          # one process each: its own peak memory, its own parallel state
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)              # a world of one, no rendezvous
        out = subprocess.run([sys.executable, __file__, f"--arm={arm}", *sys.argv[1:]], capture_output=True,
                             text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"the {arm} arm failed:\n{out.stderr[-3000:]}")
        results[arm] = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    print(report(results, args.rank, size))


if __name__ == "__main__":
    main()
