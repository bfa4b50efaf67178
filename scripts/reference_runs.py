"""Reference runs: what a refactor must reproduce step for step, and the artifacts it must leave unchanged.

    python scripts/reference_runs.py record OUT [--only NAME ...]    # run them in OUT/<name>/, keep OUT/<name>.jsonl
    python scripts/reference_runs.py compare REF NEW [--only ...]     # every logged metric but timings, per step
    python scripts/reference_runs.py record-artifacts OUT             # CLI outputs and exported tensors ->
                                                                      # OUT/artifacts/
    python scripts/reference_runs.py compare-artifacts REF NEW

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
ALL_INSTALLED = ""       # no --plugins: every installed plugin loads (a run whose plugins moved between distributions)
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
    # async with staleness 0 samples and trains what the colocated run does (rlcore.rollout.queued's promise)
    "async_s0": ("qwen3,grpo,vllm", QUICKSTART + [
        "trainer.mode=async", "rollout.max_staleness=0", "trainer.steps=30", "trainer.eval_every=15"]),
    "tool_agent": (ALL_INSTALLED, ["tool-calculator", "trainer.steps=20", "trainer.eval_every=10"]),
    # LoRA, adapters-only sync into vLLM, engine check every 5 steps; exported (hf/ and adapter/: the artifacts)
    "lora_adapters": ("qwen3,grpo,vllm", QUICKSTART + [
        "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=0.001", "rollout.lora=adapters",
        "trainer.steps=30", "trainer.eval_every=15", "trainer.check_logprobs_every=5", "trainer.export_hf=true"]),
    # the quickstart started with verl's keys (`rlcore run --verl`)
    "verl_cli": (ALL_INSTALLED, ["--verl", "quickstart", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8",
                                 "actor_rollout_ref.actor.optim.lr=1e-4", "trainer.total_training_steps=20",
                                 "trainer.test_freq=10"]),
    # saved every 4 steps, killed (SIGKILL) once step 8's checkpoint is complete, resumed to 12 (resumed_run())
    "resume": ("qwen3,grpo,vllm", QUICKSTART + ["trainer.steps=12", "trainer.eval_every=4", "trainer.save_every=4"]),
}
COMMON = ["run.progress=false", "trainer.export_hf=false"]
# Metrics read off the clock: kept as keys (a refactor must log the same keys), their values not compared.
WALL_CLOCK = ("agent/tool_seconds", "async/trainer_idle_frac", "async/rollout_idle_frac", "async/rollout_tokens_per_s",
              "async/trainer_tokens_per_s", "sync/seconds", "sync/pause_seconds")


def gsm8k_run(out: str) -> list[str]:
    """The GSM8K job in miniature (tests/e2e/test_gsm8k_e2e.py's): a tiny Qwen3 with a byte-level BPE chat tokenizer,
    GSM8K-format JSONL made verl Parquet by `rlcore dataset gsm8k`, the math reward plus a brevity shaping."""
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_testing.gsm8k import chat_tokenizer, gsm8k_lines
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


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def command(name: str, out: str, args: list[str]) -> list[str]:
    plugins = RUNS[name][0]
    # COMMON first: a run's own overrides (export_hf) win
    return [sys.executable, "-m", "rlcore.cli", "run", *([f"--plugins={plugins}"] if plugins else []), *args,
            *COMMON[:1], *(COMMON[1:] if "trainer.export_hf=true" not in args else []),
            f"run.dir={os.path.join(out, name)}", f"warm_start.cache_dir={os.path.join(out, 'warm_start')}"]


def run(name: str, cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if result.returncode:
        sys.exit(f"{name}: rlcore run failed ({result.returncode}):\n{result.stderr[-3000:]}")


def resumed_run(name: str, out: str, cmd: list[str]) -> None:
    """Start ``cmd``, SIGKILL its whole process group once the checkpoint after step 8 is complete (renamed from
    .partial-*), then ``rlcore run --resume`` the run directory to its last step."""
    import signal

    run_dir = os.path.join(out, name)
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                               start_new_session=True)
    try:
        while saved_steps(run_dir) < 8:
            if process.poll() is not None:
                sys.exit(f"{name}: the run ended ({process.returncode}) before its step-8 checkpoint")
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    plugins = RUNS[name][0]
    run(name, [sys.executable, "-m", "rlcore.cli", "run", f"--plugins={plugins}", "--resume", run_dir])


def saved_steps(run_dir: str) -> int:
    """The newest complete checkpoint's step in ``run_dir`` (checkpoints/step_<N>; .partial-* ones are still being
    written), 0 if none."""
    folder = os.path.join(run_dir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return max((int(n[len("step_"):]) for n in names if n.startswith("step_")), default=0)


def record(out: str, names: list[str]) -> None:
    for name in names:
        args = gsm8k_run(out) if name == "gsm8k_dataset" else RUNS[name][1]
        start = time.perf_counter()
        if name == "resume":
            resumed_run(name, out, command(name, out, args))
        else:
            run(name, command(name, out, args))
        run_dir = os.path.join(out, name)
        rows = metrics(run_dir)
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:       # the record to keep: timings left out
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {time.perf_counter() - start:.0f} s, {len(rows)} steps", flush=True)


def metrics(path: str) -> list[dict]:
    """A run's metrics per step (``path``: its run directory, or a kept record), timings left out (null = NaN)."""
    with open(os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: float("nan") if v is None or k.startswith(WALL_CLOCK) else v for k, v in row.items()
             if not k.startswith("time/")} for row in rows]


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


# --- artifacts: what the CLI prints and what runs write, byte for byte ---------------------------------------------
def cli(*args: str) -> str:
    """``rlcore <args>``'s exit code and output (stdout, then stderr)."""
    result = subprocess.run([sys.executable, "-m", "rlcore.cli", *args], capture_output=True, text=True, env=ENV)
    return f"exit {result.returncode}\n{result.stdout}{result.stderr}"


def verl_scripts() -> list[str]:
    """verl's published example scripts the tests translate (wherever the verl compatibility's tests keep them)."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return sorted(glob.glob(os.path.join(root, "tests", "data", "verl", "*.sh"))
                  or glob.glob(os.path.join(root, "contrib", "*", "*", "tests", "data", "verl", "*.sh")))


def tensor_digests(directory: str) -> dict[str, str]:
    """sha256 of every tensor in ``directory``'s safetensors files, by name."""
    import hashlib
    import glob

    from safetensors import safe_open

    digests = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).contiguous()
                digests[name] = f"{tensor.dtype} {list(tensor.shape)} " + hashlib.sha256(
                    tensor.view(-1).view(torch_uint8()).numpy().tobytes()).hexdigest()
    return digests


def torch_uint8():
    import torch

    return torch.uint8


def without_paths(value, out: str):
    """``value`` with the recording's directory written as <OUT> (two recordings live in different places)."""
    if isinstance(value, dict):
        return {k: without_paths(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [without_paths(v, out) for v in value]
    return value.replace(out, "<OUT>") if isinstance(value, str) else value


def record_artifacts(out: str) -> None:
    """CLI outputs (plugins per kind, --help-config, --dry-run of every preset, verl translations) and, from the
    recorded runs in ``out``, the exported tensors' digests and the resolved config (paths as <OUT>)."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found: dict[str, str] = {}
    listing = json.loads(cli("plugins", "--json").split("\n", 1)[1])
    kinds: dict[str, list[str]] = {}
    for plugin in listing if isinstance(listing, list) else listing.get("plugins", []):
        for kind, names in plugin.get("registers", {}).items():
            kinds.setdefault(kind, []).extend(names)
    found["plugins.json"] = json.dumps({k: sorted(v) for k, v in sorted(kinds.items())}, indent=1)
    found["help-config.txt"] = cli("run", "--help-config")
    for preset in sorted(glob.glob(os.path.join(root, "configs", "*.yaml"))):
        name = os.path.basename(preset)[:-5]
        found[f"dry-run/{name}.txt"] = cli("run", "--dry-run", name)
    for script in verl_scripts():
        found[f"verl-translate/{os.path.basename(script)}.txt"] = cli("verl", "translate", script).replace(
            os.path.dirname(script), "<DIR>")
    for name in RUNS:
        run_dir = os.path.join(out, name)
        for sub in ("hf", "adapter"):
            if os.path.isdir(os.path.join(run_dir, sub)):
                found[f"tensors/{name}-{sub}.json"] = json.dumps(tensor_digests(os.path.join(run_dir, sub)), indent=1)
        if os.path.exists(os.path.join(run_dir, "run.json")):
            with open(os.path.join(run_dir, "run.json")) as f:
                config = json.load(f)["config"]
            found[f"config/{name}.json"] = json.dumps(without_paths(config, out), indent=1, sort_keys=True)
    for rel, text in found.items():
        path = os.path.join(out, "artifacts", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    print(f"artifacts: {len(found)} written to {os.path.join(out, 'artifacts')}")


def compare_artifacts(reference: str, new: str) -> int:
    import filecmp

    def files(top: str) -> set[str]:
        top = os.path.join(top, "artifacts")
        return {os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs}

    ref, now = files(reference), files(new)
    differ = sorted(rel for rel in ref & now if not filecmp.cmp(os.path.join(reference, "artifacts", rel),
                                                                  os.path.join(new, "artifacts", rel), shallow=False))
    for rel in sorted(ref - now):
        print(f"{rel}: missing now")
    for rel in sorted(now - ref):
        print(f"{rel}: new")
    for rel in differ:
        print(f"{rel}: differs")
    bad = len(differ) + len(ref ^ now)
    print(f"artifacts: {len(ref) - bad + len(now - ref)} of {len(ref | now)} identical")
    return 1 if bad else 0


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
    rec_art = sub.add_parser("record-artifacts")
    rec_art.add_argument("out")
    cmp_art = sub.add_parser("compare-artifacts")
    cmp_art.add_argument("reference")
    cmp_art.add_argument("new")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.only)
    elif args.command == "record-artifacts":
        record_artifacts(os.path.abspath(args.out))
    elif args.command == "compare-artifacts":
        sys.exit(compare_artifacts(args.reference, args.new))
    else:
        sys.exit(compare(args.reference, args.new, args.only))


if __name__ == "__main__":
    main()
