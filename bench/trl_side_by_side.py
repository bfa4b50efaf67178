"""rlcore against TRL's GRPOTrainer on the quickstart, side by side, from the same starting checkpoint.

    python bench/trl_side_by_side.py [--seeds 0,1,2] [--steps 300] [--cores 1] [--smoke] [key=value ...]

TRL (``TRL_PIN``) lives in a venv of its own (``TRL_VENV``, made on first use: ``--prepare`` makes it and exits;
``scripts/install.sh`` does that), layered on this one (it sees rlcore's packages through a ``site.addsitedir``
line), so that it never changes rlcore's environment. For each seed, from the quickstart's warm-started checkpoint
(the run seed 0 one, for every seed):
- ``rlcore run --plugins=qwen3,grpo,vllm quickstart model.path=<it> run.seed=<seed> trainer.steps=<steps>
  trainer.eval_every=0`` as a user runs it (its median ``time/step``), colocated on one core; with ``--cores 2``
  in async mode, the trainer and one rollout worker (``trainer.mode=async rollout.world_size=1``, staleness 1);
- TRL 1.16's GRPOTrainer with the same batch (16 prompts x 8 samples, one optimizer update per batch), the same
  prompts in the same order (step k trains on ``task.train_prompts(k, 16)``, TRL's shuffling off), the same
  algorithm (clipped surrogate at 0.2, no KL, group-normalised advantages, token-mean loss: TRL's ``dapo``), the same
  optimizer (Adam, lr 1e-4 constant, betas 0.9/0.999, gradient clip 1.0), response length and temperature, the same
  exact-match reward, fp32 on the CPU, generating with transformers (TRL's default), ``--cores`` torch threads; its
  median step time from a trainer callback (generation, reward and update, as rlcore's step);
- one evaluator for both final checkpoints and the starting one: greedy answers to the task's 200 held-out prompts
  from a vLLM engine, scored by the run's exact-match reward.
``key=value``: overrides of the quickstart's starting model, e.g. ``model.tiny.hidden_size=512`` to compare at
another size (its warm start built and cached for it, as ``rlcore run`` does). Seeds run one after another (never
beside each other). Last line: ``rlcore/TRL step time <x>, final accuracy <a> vs <b>`` (the mean over seeds of the
ratio of median step times; the mean accuracies). Goal (issue 39): <= 0.85x with accuracy level or better.
``--smoke`` (tests/integration/test_bench_smoke.py): one seed, 2 steps of 4 prompts x 2 samples from the model as
built (no warm start), 20 held-out prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

TRL_PIN = "trl==1.16.0"
# what TRL adds to this venv's stack, pinned; installed without dependency resolution, which would judge this venv's
# whole stack (SGLang's declared CUDA pins among it) rather than what TRL needs
TRL_REQUIREMENTS = [TRL_PIN, "datasets==5.2.0", "multiprocess==0.70.19", "pandas==3.1.1"]
TRL_VENV = os.environ.get("RLCORE_TRL_VENV", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), ".venv-trl"))
SMOKE = dict(prompts=4, n=2, steps=2, eval_size=20)
ASYNC = ["trainer.mode=async", "trainer.world_size=1", "rollout.world_size=1"]     # rlcore's runs with --cores 2


def trl_python() -> str:
    """The TRL venv's interpreter, the venv made first unless a previous making finished (pip, network)."""
    python, ready = os.path.join(TRL_VENV, "bin", "python"), os.path.join(TRL_VENV, "rlcore-ready")
    if not os.path.exists(ready):
        subprocess.run([sys._base_executable, "-m", "venv", "--clear", TRL_VENV], check=True)
        site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        with open(os.path.join(site_dir, "rlcore_venv.pth"), "w") as f:     # this venv's packages, .pth files too
            f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        *TRL_REQUIREMENTS], check=True)
        open(ready, "w").close()
    return python


def rlcore_run(checkpoint: str, seed: int, steps: int, batch: dict, cores: int, run_dir: str) -> dict:
    """``rlcore run`` as a user runs it; its median step time and its exported final checkpoint."""
    overrides = [f"model.path={checkpoint}", f"run.dir={run_dir}", f"run.seed={seed}", f"trainer.steps={steps}",
                 "trainer.eval_every=0", "run.progress=false", "trainer.loggers=[jsonl]",
                 f"trainer.prompts_per_step={batch['prompts']}", f"rollout.n={batch['n']}",
                 *(ASYNC if cores == 2 else [])]
    rlcore = os.path.join(os.path.dirname(sys.executable), "rlcore")
    subprocess.run([rlcore, "run", "--plugins=qwen3,grpo,vllm", "quickstart", *overrides], check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps_s = [row["time/step"] for row in map(json.loads, f) if "time/step" in row]
    return dict(step_s=after_first(steps_s), final=os.path.join(run_dir, "hf"))


def trl_run(checkpoint: str, seed: int, steps: int, batch: dict, cores: int, out: str) -> dict:
    """TRL's GRPOTrainer on the same prompts, in the TRL venv; its median step time and final checkpoint."""
    spec = dict(checkpoint=checkpoint, seed=seed, steps=steps, batch=batch, threads=cores, out=out)
    subprocess.run([trl_python(), os.path.abspath(__file__), "--trl-run", json.dumps(spec)], check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "steps.json")) as f:
        return dict(step_s=after_first(json.load(f)), final=os.path.join(out, "hf"))


def after_first(seconds: list[float]) -> float:
    """The median step time, the first step (one-off warm-up costs) left out."""
    return statistics.median(seconds[1:] or seconds)


def trl_main(spec: dict) -> None:
    """In the TRL venv: train, time each step, save the final model."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins

    torch.set_num_threads(spec["threads"])
    cfg = load_config("quickstart", [f"run.seed={spec['seed']}"])
    registry = load_plugins(["qwen3", "grpo"]).registry
    task = registry.get("tasks", cfg.task.name).build(dict(cfg.task.options), cfg.run.seed)
    exact_match = registry.get("rewards", "exact_match").fn
    prompts, n = spec["batch"]["prompts"], spec["batch"]["n"]
    rows = [(p, m["answer"]) for step in range(1, spec["steps"] + 1) for p, m in task.train_prompts(step, prompts)]
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    def reward(prompts, completions, answer, **_):
        return exact_match(completions, [{"answer": a} for a in answer])

    optim = cfg.actor.optim
    args = GRPOConfig(output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=prompts * n,
                      num_generations=n, gradient_accumulation_steps=1, shuffle_dataset=False, seed=spec["seed"],
                      learning_rate=optim.lr, lr_scheduler_type="constant", warmup_steps=0,
                      weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
                      adam_epsilon=optim.adam_eps, max_grad_norm=optim.clip_grad, beta=0.0, epsilon=0.2,
                      loss_type="dapo", scale_rewards="group", max_completion_length=cfg.rollout.max_response_len,
                      temperature=cfg.rollout.temperature, use_cpu=True, bf16=False, report_to=[],
                      save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    times = StepTimes()
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[times])
    trainer.train()
    trainer.save_model(os.path.join(spec["out"], "hf"))
    tokenizer.save_pretrained(os.path.join(spec["out"], "hf"))
    with open(os.path.join(spec["out"], "steps.json"), "w") as f:
        json.dump(times.seconds, f)


def held_out_accuracy(checkpoint: str, eval_size: int | None) -> float:
    """The one evaluator: greedy answers to the held-out prompts from a vLLM engine, exact-match scored."""
    from transformers import AutoTokenizer

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins
    from rlcore.rollout.requests import sample
    from rlcore.specs import Sampling

    cfg = load_config("quickstart", [])
    registry = load_plugins(["qwen3", "grpo", "vllm"]).registry
    task = registry.get("tasks", cfg.task.name).build(dict(cfg.task.options), cfg.run.seed)
    held_out = task.eval_prompts()[:eval_size]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p, _ in held_out]
    max_len = json.load(open(os.path.join(checkpoint, "config.json")))["max_position_embeddings"]
    engine = registry.get("rollout_backends", "vllm").factory(checkpoint, cfg.rollout, max_model_len=max_len)
    try:
        answers = sample(engine, prompts, 1, Sampling(cfg.rollout.max_response_len, temperature=0.0), tag="eval")
    finally:
        engine.stop()
    texts = [tokenizer.decode(group[0].tokens, skip_special_tokens=True) for group in answers]
    scores = registry.get("rewards", "exact_match").fn(texts, [m for _, m in held_out])
    return sum(scores) / len(scores)


def evaluate_to(checkpoints: list[str], eval_size: int | None, out: str) -> None:
    """The evaluator over several checkpoints, in a process of its own (each vLLM engine binds the process)."""
    subprocess.run([sys.executable, os.path.abspath(__file__), "--evaluate", json.dumps([checkpoints, eval_size]),
                    "--out", out], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cores", type=int, choices=[1, 2], default=1, help="each side's cores (see above)")
    parser.add_argument("--smoke", action="store_true", help="2 small steps, one seed: a check that it runs")
    parser.add_argument("--prepare", action="store_true", help="make the TRL venv and exit")
    parser.add_argument("--trl-run", help=argparse.SUPPRESS)
    parser.add_argument("--evaluate", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="the starting model's quickstart overrides (see above)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.trl_run:
        trl_main(json.loads(args.trl_run))
        return 0
    if args.evaluate:
        checkpoints, eval_size = json.loads(args.evaluate)
        with open(args.out, "w") as f:
            json.dump([held_out_accuracy(c, eval_size) for c in checkpoints], f)
        return 0
    python = trl_python()
    if args.prepare:
        print(f"TRL venv: {python}")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rollout_floor import quickstart_checkpoint

    seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
    steps = SMOKE["steps"] if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as work:
        smoke = ["warm_start.steps=0", "warm_start.target_accuracy=0", f"warm_start.cache_dir={work}/cache"]
        cfg, _, checkpoint = quickstart_checkpoint((smoke if args.smoke else []) + args.overrides)
        batch = dict(prompts=SMOKE["prompts"], n=SMOKE["n"]) if args.smoke else \
            dict(prompts=cfg.trainer.prompts_per_step, n=cfg.rollout.n)
        rows = []
        for seed in seeds:
            ours = rlcore_run(checkpoint, seed, steps, batch, args.cores, os.path.join(work, f"rlcore-{seed}"))
            theirs = trl_run(checkpoint, seed, steps, batch, args.cores, os.path.join(work, f"trl-{seed}"))
            rows.append(dict(seed=seed, ours=ours, theirs=theirs))
        accuracies = os.path.join(work, "accuracies.json")
        evaluate_to([checkpoint] + [r[side]["final"] for r in rows for side in ("ours", "theirs")],
                    SMOKE["eval_size"] if args.smoke else None, accuracies)
        start, *finals = json.load(open(accuracies))
    print(f"quickstart{' (' + ' '.join(args.overrides) + ')' if args.overrides else ''}: {batch['prompts']} prompts "
          f"x {batch['n']} samples, {steps} steps, from held-out accuracy "
          f"{start:.3f}; {TRL_PIN} (transformers generation, {args.cores} torch threads), rlcore with vLLM "
          f"({'async, a trainer and a rollout worker' if args.cores == 2 else 'colocated, one process'})")
    print(f"{'seed':>4} {'rlcore step s':>13} {'TRL step s':>10} {'rlcore/TRL':>10} {'rlcore acc':>10} {'TRL acc':>8}")
    for row, (ours_acc, theirs_acc) in zip(rows, zip(finals[::2], finals[1::2])):
        row.update(ratio=row["ours"]["step_s"] / row["theirs"]["step_s"], ours_acc=ours_acc, theirs_acc=theirs_acc)
        print(f"{row['seed']:>4} {row['ours']['step_s']:>13.3f} {row['theirs']['step_s']:>10.3f} "
              f"{row['ratio']:>10.2f} {ours_acc:>10.3f} {theirs_acc:>8.3f}")
    mean = lambda key: statistics.mean(r[key] for r in rows)     # noqa: E731
    print(f"rlcore/TRL step time {mean('ratio'):.2f}x, final accuracy {mean('ours_acc'):.3f} vs "
          f"{mean('theirs_acc'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
