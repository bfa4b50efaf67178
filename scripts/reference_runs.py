"""Reference runs: what a refactor must reproduce step for step.

    python scripts/reference_runs.py record OUT [--only NAME ...]    # run them in OUT/<name>/, keep OUT/<name>.jsonl
    python scripts/reference_runs.py compare REF NEW [--only ...]     # every logged metric but timings, per step

Each run is `rlcore run` as a user starts it, with every random choice fixed by its seed; on one CPU machine a run is
bit-exact, so `compare` asks for equality (NaN equals NaN) and reports the first step and metric that differ. The
kept records (timings left out) live in docs/reference_runs/, with the commit and machine they came from."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

QUICKSTART = ["quickstart"]
RUNS: dict[str, tuple[str, list[str]]] = {
    # name: (plugins, preset and overrides)
    "quickstart": ("qwen3,grpo,vllm", QUICKSTART),
    "ppo_critic_kl": ("qwen3,ppo,vllm", QUICKSTART + [
        "algorithm.name=ppo", "critic.optim.lr=0.001", "algorithm.kl_coef=0.05", "algorithm.kl_target=0.01",
        "trainer.steps=60", "trainer.eval_every=30"]),
    "rloo": ("qwen3,rloo,vllm", QUICKSTART + ["algorithm.name=rloo", "trainer.steps=60", "trainer.eval_every=30"]),
    "dynamic_sampling": ("qwen3,grpo,vllm", QUICKSTART + [
        "algorithm.dynamic_sampling=true", "trainer.steps=40", "trainer.eval_every=20"]),
    "tp2xpp2": ("qwen3,grpo,vllm", QUICKSTART + [
        "trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.pp=2", "trainer.steps=20",
        "trainer.eval_every=10", "trainer.check_logprobs_every=5"]),
    "gsm8k_dataset": ("qwen3,grpo,vllm", []),     # built by gsm8k_run(): its data and checkpoint are written first
    "sglang_quickstart": ("qwen3,grpo,sglang", QUICKSTART + [
        "rollout.backend=sglang", "trainer.steps=30", "trainer.eval_every=15"]),
}
COMMON = ["run.progress=false", "trainer.export_hf=false"]


def gsm8k_run(out: str) -> list[str]:
    """The GSM8K job in miniature (tests/test_gsm8k_e2e.py's): a tiny Qwen3 with a byte-level BPE chat tokenizer,
    GSM8K-format JSONL made verl Parquet by `rlcore dataset gsm8k`, the math reward plus a brevity shaping."""
    from rlcore.testing import tiny_checkpoint
    from rlcore.testing.gsm8k import chat_tokenizer, gsm8k_lines
    from rlcore_model_qwen3.plugin import QWEN3

    data = os.path.join(out, "gsm8k_data")
    os.makedirs(data, exist_ok=True)
    tokenizer = chat_tokenizer()
    ckpt = os.path.join(data, "ckpt")
    tiny_checkpoint(QWEN3, ckpt, vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=32, ffn_hidden_size=128, max_position_embeddings=512,
                    eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(ckpt)
    for split, count, offset in (("train", 48, 0), ("test", 8, 100)):
        jsonl = os.path.join(data, f"{split}.jsonl")
        with open(jsonl, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in gsm8k_lines(count, offset))
        subprocess.run([sys.executable, "-m", "rlcore.cli", "dataset", "gsm8k", jsonl,
                        os.path.join(data, f"{split}.parquet"), f"--split={split}"], check=True)
    with open(os.path.join(data, "shaping.py"), "w") as f:
        f.write("def brevity(responses, metadata):\n    return [-len(r) / 200 for r in responses]\n")
    return ["quickstart", f"model.path={ckpt}", "task.name=dataset",
            f"task.options.train_files=[{data}/train.parquet]", f"task.options.val_files=[{data}/test.parquet]",
            f"task.reward_fn={data}/shaping.py:brevity", "task.rewards={math: 1.0, brevity: 0.1}",
            "trainer.steps=8", "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_response_len=48",
            "trainer.eval_every=4", "trainer.eval_n=2", "trainer.eval_temperature=1.0",
            "trainer.check_logprobs_every=1", "actor.micro_batch_size=16", "actor.optim.lr_warmup_steps=2"]


def record(out: str, names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in names:
        plugins, args = RUNS[name]
        if name == "gsm8k_dataset":
            args = gsm8k_run(out)
        run_dir = os.path.join(out, name)
        command = [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}", *args, *COMMON,
                   f"run.dir={run_dir}", f"warm_start.cache_dir={os.path.join(out, 'warm_start')}"]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode:
            sys.exit(f"{name}: rlcore run failed ({result.returncode}):\n{result.stderr[-3000:]}")
        rows = metrics(run_dir)
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:       # the record to keep: timings left out
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {time.perf_counter() - start:.0f} s, {len(rows)} steps", flush=True)


def metrics(path: str) -> list[dict]:
    """A run's metrics per step (``path``: its run directory, or a kept record), timings left out (null = NaN)."""
    with open(os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: float("nan") if v is None else v for k, v in row.items() if not k.startswith("time/")}
            for row in rows]


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def differences(reference: list[dict], new: list[dict]) -> list[str]:
    """Each step and metric where the runs differ (a metric only one of them logged counts)."""
    found = [] if len(reference) == len(new) else [f"{len(reference)} steps logged, now {len(new)}"]
    for ref, now in zip(reference, new):
        for key in sorted(ref.keys() | now.keys()):
            if key not in ref or key not in now:
                found.append(f"step {ref['step']}: {key} logged {'now only' if key in now else 'before only'}")
            elif not same(ref[key], now[key]):
                found.append(f"step {ref['step']}: {key} {ref[key]!r} -> {now[key]!r}")
    return found


def compare(reference: str, new: str, names: list[str]) -> int:
    failed = 0
    for name in names:
        found = differences(metrics(os.path.join(reference, f"{name}.jsonl")),
                            metrics(os.path.join(new, f"{name}.jsonl")))
        failed += bool(found)
        print(f"{name}: {'identical' if not found else f'{len(found)} differences, first: ' + found[0]}")
    print(f"reference runs: {len(names) - failed} of {len(names)} identical step by step (timings left out)")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out")
    cmp = sub.add_parser("compare")
    cmp.add_argument("reference")
    cmp.add_argument("new")
    for p in (rec, cmp):
        p.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.only)
    else:
        sys.exit(compare(args.reference, args.new, args.only))


if __name__ == "__main__":
    main()
