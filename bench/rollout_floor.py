"""The rollout phase against the engine's floor: rlcore's per-request path against the same engine's own offline
batch generate, on the same prompts, seeds and lengths, for each rollout backend.

    python bench/rollout_floor.py [--backend vllm,sglang] [--repeats N] [--profile] [--smoke]

Two batches, each on its own model:
- ``quickstart``: the quickstart's warm-started checkpoint (the warm-start cache runs use), the prompts of its first
  training step (16 x 8 samples), its temperature and response length;
- ``long``: a random Qwen3 of the quickstart's shape (with 512 positions) and a 16k vocabulary, so that eos comes
  about once in 16k tokens and every response runs to its length: 16 prompts of 16 tokens x 8 samples of 256 tokens.

Per backend (each in its own process) and batch: one warm-up of each path, then ``--repeats`` pairs (default:
REPEATS: the quickstart's batch takes ~0.1 s and varies, the long one 10-30 s) alternating the per-request path
(``rlcore.rollout.requests.episodes`` with the built-in single-turn agent: every sample its own ``generate``
request, what the colocated source runs) and the offline one (vLLM: ``LLM.generate``, one request of n samples per
prompt; SGLang: ``Engine.generate`` of the whole batch at once), each with token logprobs. A pair's ratio is of
seconds per generated token (the paths draw the same tokens where the engine seeds each request: vLLM; "same
samples" says how many agree), the median of the pairs is the row's. Goal (issue 39): <= 1.10x.
``--profile``: cProfile of one per-request pass per batch, top functions by own time (stderr). Last line:
``worst per-request/offline <x>x (<backend> <batch>)``.
``--smoke`` (tests/integration/test_bench_smoke.py): vLLM unless ``--backend`` is given, 4 prompts x 2 samples per
batch (the quickstart's model as built, no warm start; the long batch's of 16 tokens), one repeat.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("OMP_NUM_THREADS", "1")

LONG = dict(prompts=16, prompt_len=16, n=8, max_tokens=256, vocab=16384)
SMOKE_BATCH = dict(prompts=4, n=2)
REPEATS = {"quickstart": 25, "long": 5}
SMOKE_LONG = dict(LONG, prompts=4, n=2, max_tokens=16)


def quickstart_checkpoint(overrides: list[str]):
    """(config, task, starting checkpoint) of the quickstart with ``overrides``: the warm start runs use (built and
    cached on first use, as ``rlcore run`` does)."""
    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.warm_start import starting_checkpoint

    cfg = load_config("quickstart", ["run.progress=false", *overrides])
    registry = load_plugins(["qwen3", "grpo"]).registry
    task = registry.get("tasks", cfg.task.name).build(dict(cfg.task.options), cfg.run.seed)
    return cfg, task, starting_checkpoint(cfg, registry)


def quickstart_batch(args, cache: str | None):
    """(checkpoint, prompts as token ids, n, Sampling, seeds) of the quickstart's first training step."""
    from transformers import AutoTokenizer

    from rlcore.rollout.source import prompt_seeds
    from rlcore.specs import Sampling

    smoke = ["warm_start.steps=0", "warm_start.target_accuracy=0", f"warm_start.cache_dir={cache}",
             f"trainer.prompts_per_step={SMOKE_BATCH['prompts']}", f"rollout.n={SMOKE_BATCH['n']}"]
    cfg, task, checkpoint = quickstart_checkpoint(smoke if args.smoke else [])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = task.train_prompts(1, cfg.trainer.prompts_per_step)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text, _ in texts]
    seeds = prompt_seeds(len(prompts), cfg.run.seed, "train", 1, 1)
    return checkpoint, prompts, cfg.rollout.n, Sampling(cfg.rollout.max_response_len, cfg.rollout.temperature), seeds


def long_batch(args, directory: str):
    """The same for the long batch, on a random model written to ``directory``."""
    from transformers import AutoTokenizer

    from rlcore.config import load_config
    from rlcore.specs import Sampling
    from weight_sync import make_checkpoint

    shape = SMOKE_LONG if args.smoke else LONG
    tiny = load_config("quickstart", []).model.tiny
    make_checkpoint(directory, "float32", {**dataclasses.asdict(tiny), "max_position_embeddings": 512},
                    shape["vocab"])
    known = len(AutoTokenizer.from_pretrained(directory))     # prompt ids the engine's tokenizer knows
    rng = random.Random(0)
    prompts = [[rng.randrange(3, known) for _ in range(shape["prompt_len"])] for _ in range(shape["prompts"])]
    return directory, prompts, shape["n"], Sampling(shape["max_tokens"], 1.0), list(range(shape["prompts"]))


def offline(backend: str, engine, prompts, n, sampling, seeds) -> list[list[list[int]]]:
    """The engine's own batch generate of the same samples: each prompt's n responses' token ids."""
    if backend == "vllm":
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=n, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k, max_tokens=sampling.max_tokens,
                                 stop_token_ids=list(sampling.stop_token_ids), logprobs=0, detokenize=False)
                  for seed in seeds]
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[list(o.token_ids) for o in out.outputs] for out in outputs]
    if backend == "sglang":
        from rlcore_rollout_sglang.messages import sampling_params as _sampling_params

        outputs = engine.engine.generate(input_ids=[p for p in prompts for _ in range(n)],
                                         sampling_params=[_sampling_params(sampling, seed + j)
                                                          for seed in seeds for j in range(n)],
                                         return_logprob=True)
        flat = [list(o["output_ids"]) for o in outputs]
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
    raise ValueError(f"--backend {backend!r}: expected vllm or sglang")


def measure(backend: str, args) -> list[dict]:
    """Each batch's row for ``backend``, in this process."""
    import torch

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.rollout.agents import SingleTurn
    from rlcore.rollout.requests import episodes

    torch.set_num_threads(1)
    spec = load_plugins([backend]).registry.get("rollout_backends", backend)
    rollout_cfg = load_config("quickstart", []).rollout
    rows = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as long_dir:
        for name, batch in (("quickstart", lambda: quickstart_batch(args, cache)),
                            ("long", lambda: long_batch(args, long_dir))):
            checkpoint, prompts, n, sampling, seeds = batch()
            max_len = json.load(open(os.path.join(checkpoint, "config.json")))["max_position_embeddings"]
            engine = spec.factory(checkpoint, rollout_cfg, seed=0, max_model_len=max_len)
            try:
                per_request = lambda: [[t.tokens[len(prompt):] for t in group]     # noqa: E731
                                       for prompt, group in zip(prompts, episodes(
                                           SingleTurn(), engine, prompts, [{}] * len(prompts), n, sampling, seeds,
                                           tag=name))]
                paths = {"per-request": per_request,
                         "offline": lambda: offline(backend, engine, prompts, n, sampling, seeds)}
                for path in paths.values():     # warm-up: the first generate pays one-off costs
                    path()
                seconds: dict[str, list[float]] = {p: [] for p in paths}
                tokens: dict[str, list[int]] = {p: [] for p in paths}
                samples: dict[str, list] = {}
                for _ in range(args.repeats or REPEATS[name]):
                    for p, path in paths.items():
                        start = time.perf_counter()
                        samples[p] = path()
                        seconds[p].append(time.perf_counter() - start)
                        tokens[p].append(sum(len(s) for group in samples[p] for s in group))
                if args.profile:
                    profile(per_request, name)
            finally:
                engine.stop()
            ratios = [(s / t) / (so / to) for s, t, so, to in zip(seconds["per-request"], tokens["per-request"],
                                                                 seconds["offline"], tokens["offline"])]
            same = sum(a == b for ga, gb in zip(samples["per-request"], samples["offline"]) for a, b in zip(ga, gb))
            rows.append(dict(backend=backend, batch=name, samples=len(prompts) * n, same=same,
                             tokens=statistics.median(tokens["per-request"]),
                             offline_tokens=statistics.median(tokens["offline"]),
                             per_request_s=statistics.median(seconds["per-request"]),
                             offline_s=statistics.median(seconds["offline"]), ratio=statistics.median(ratios)))
    return rows


def profile(run, name: str) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    print(f"--- {name}: per-request pass, top functions by own time", file=sys.stderr)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", help="rollout backends, comma-separated (default: vllm,sglang; --smoke: vllm)")
    parser.add_argument("--repeats", type=int, help="timed pairs per batch, after a warm-up of each (default: "
                                                    "REPEATS)")
    parser.add_argument("--profile", action="store_true", help="cProfile one per-request pass per batch (stderr)")
    parser.add_argument("--smoke", action="store_true", help="tiny batches, one repeat: a check that it runs")
    parser.add_argument("--measure-to", help=argparse.SUPPRESS)     # one backend's rows, in its own process
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1
    if args.measure_to:
        with open(args.measure_to, "w") as f:
            json.dump(measure(args.backend, args), f)
        return 0
    rows = []
    for backend in (args.backend or ("vllm" if args.smoke else "vllm,sglang")).split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, __file__, "--backend", backend, "--measure-to", out.name,
                            *(["--repeats", str(args.repeats)] if args.repeats else []),
                            *(["--smoke"] if args.smoke else []), *(["--profile"] if args.profile else [])],
                           check=True)
            rows += json.load(open(out.name))
    columns = ["backend", "batch", "samples", "tokens", "offline tokens", "same samples", "per-request s",
               "offline s", "per-request/offline"]
    print(" ".join(f"{c:>{max(len(c), 8)}}" for c in columns))
    for r in rows:
        values = [r["backend"], r["batch"], r["samples"], f"{r['tokens']:.0f}", f"{r['offline_tokens']:.0f}",
                  r["same"], f"{r['per_request_s']:.3f}", f"{r['offline_s']:.3f}", f"{r['ratio']:.2f}"]
        print(" ".join(f"{v:>{max(len(c), 8)}}" for c, v in zip(columns, values)))
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst per-request/offline {worst['ratio']:.2f}x ({worst['backend']} {worst['batch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
