"""What carrying the rollout's routed experts costs (routing replay, ``actor.moe.routing_replay=rollout``, "R3"):
their bytes per token for published MoE configs and the tiny model, and the step time of one colocated run with
replay off, on, and on with the live-routing metrics.

    python bench/routing_replay.py [--steps 12] [--repeats 3] [--keep DIR] [--smoke] [key=value ...]

Bytes: a token's routes are the top-k expert ids of every MoE layer, int16 (``rlcore.routed_experts.route_bytes``),
for published configs (their config.json values below, as data, each with its source; the MoE layers follow from
them by ``rlcore.routed_experts.hf_moe_layers``, the convention the engines' rows are read by) and the tiny
qwen3_moe the runs train; per token and per sample of 32K tokens. Beside them, for the runs' batch shape: the
routes' bytes against those of the other tensors ``rlcore.trajectory.to_batch`` makes (input_ids, response_mask,
rollout_logprobs per token; lengths, rewards, group ids and versions per row), all padded to the batch's width.

Time: real ``rlcore run`` s of the tiny qwen3_moe (``--plugins=qwen3,grpo,hf model.family=qwen3_moe
rollout.backend=hf``: the transformers rollout backend, which returns routes, colocated in this process, one rank),
the same seed, warm start (``warm_start.steps=20``, cached in the runs' folder by the first run) and steps, one after
another: *off* (``actor.moe.routing_replay=off``: the engine records nothing, the learner routes live), *replay*
(``routing_replay=rollout measure_live_routing=false``: the engine hooks its routers, the routes ride in the batch,
the learner's MoE layers replay them) and *replay+live* (the same plus the default ``measure_live_routing=true``:
one more forward pass a step, routed live, for the routing/* metrics). ``--repeats`` rounds of the three, the arms'
order rotated each round; per arm the median of ``time/step`` (and of its phases) over every round's steps after the
first (which pays one-off warm-up), from each run's metrics.jsonl; ratios against *off*. With the same seed the arms
sample the same episodes while their weights stay equal (replayed routes are the live ones on-policy in fp32): the
rewards per step are compared to show it.

Last line: ``routing_replay: routes <b> B/token (DeepSeek-V3), step time with replay <r1>x, with replay and
live-routing metrics <r2>x (tiny qwen3_moe, hf)``.
``--smoke`` (tests/integration/test_bench_smoke.py): one round of 2 steps (one timed) of 4 prompts x 2 samples,
from the model as built (no warm start). The runs' folder is removed after a run that ends well, unless it is
``--keep``'s.
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

# published configs: the config.json values the routes' size follows from, and where they are from (the same
# values as the bundled configs/models/*.json where there is one)
PUBLISHED = {
    "DeepSeek-V3": dict(source="deepseek-ai/DeepSeek-V3 config.json", num_hidden_layers=61,
                        first_k_dense_replace=3, moe_layer_freq=1, n_routed_experts=256, num_experts_per_tok=8),
    "Qwen3-235B-A22B": dict(source="Qwen/Qwen3-235B-A22B config.json", num_hidden_layers=94, decoder_sparse_step=1,
                            mlp_only_layers=[], num_experts=128, num_experts_per_tok=8),
    "Qwen3-30B-A3B": dict(source="Qwen/Qwen3-30B-A3B config.json", num_hidden_layers=48, decoder_sparse_step=1,
                          mlp_only_layers=[], num_experts=128, num_experts_per_tok=8),
    "Moonlight-16B-A3B": dict(source="moonshotai/Moonlight-16B-A3B config.json", num_hidden_layers=27,
                              first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=64, num_experts_per_tok=6),
    "Qwen2-57B-A14B": dict(source="Qwen/Qwen2-57B-A14B config.json", num_hidden_layers=28, decoder_sparse_step=1,
                           num_experts=64, num_experts_per_tok=8),
    "Mixtral-8x7B": dict(source="mistralai/Mixtral-8x7B-v0.1 config.json", num_hidden_layers=32,
                         num_local_experts=8, num_experts_per_tok=2),
}
HEADLINE = "DeepSeek-V3"
SAMPLE_TOKENS = 32768
BASE = ["--plugins=qwen3,grpo,hf", "model.family=qwen3_moe", "rollout.backend=hf", "warm_start.target_accuracy=0",
        "trainer.eval_every=0", "task.options.eval_size=8", "trainer.export_hf=false", "run.progress=false",
        "trainer.loggers=[jsonl]", "run.seed=0"]
ARMS = {"off": ["actor.moe.routing_replay=off"],
        "replay": ["actor.moe.routing_replay=rollout", "actor.moe.measure_live_routing=false"],
        "replay+live": ["actor.moe.routing_replay=rollout", "actor.moe.measure_live_routing=true"]}
PHASES = ("rollout", "logprobs", "live_routing", "train", "sync")
SMOKE = ["warm_start.steps=0", "trainer.prompts_per_step=4", "rollout.n=2"]
KIB, MIB = 1 << 10, 1 << 20


def routes_per_token(hf: dict) -> tuple[int, int, int]:
    """(MoE layers, top_k, bytes per token) of a HF config's routes."""
    from rlcore.routed_experts import hf_moe_layers, route_bytes

    layers, top_k = len(hf_moe_layers(hf)), hf["num_experts_per_tok"]
    return layers, top_k, route_bytes(1, layers, top_k)


def tiny_hf_config(overrides: list[str]) -> dict:
    """The tiny qwen3_moe the runs build (its HF config, as ``rlcore run`` makes it from model.tiny)."""
    import dataclasses

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins

    cfg = load_config(None, ["model.family=qwen3_moe", *overrides])
    spec = load_plugins(["qwen3"]).registry.get("models", "qwen3_moe")
    return spec.tiny_hf_config(vocab_size=64, **dataclasses.asdict(cfg.model.tiny))


def batch_bytes(rows: int, width: int, layers: int, top_k: int) -> tuple[int, int]:
    """(routes, every other tensor) bytes of ``to_batch``'s batch of ``rows`` trajectories ``width`` tokens long."""
    import torch

    from rlcore.routed_experts import ROUTED_EXPERTS, as_routes
    from rlcore.trajectory import Trajectory, to_batch

    trajectories = [Trajectory.single_turn([1] * (width // 2), [2] * (width - width // 2), [0.0] * (width - width // 2),
                                           routed_experts=as_routes(torch.zeros(width - 1, layers, top_k)))
                    for _ in range(rows)]
    tensors = to_batch(trajectories, pad_id=0).tensors
    size = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    return size[ROUTED_EXPERTS], sum(v for k, v in size.items() if k != ROUTED_EXPERTS)


def run(arm: str, run_dir: str, args) -> list[dict]:
    """One ``rlcore run`` to its end; its per-step metrics."""
    command = [sys.executable, "-m", "rlcore.cli", "run", *BASE, f"trainer.steps={args.steps}",
               f"warm_start.cache_dir={args.cache}", f"run.dir={run_dir}", *ARMS[arm], *args.overrides]
    print(f"  {arm}: {' '.join(command[3:])}", flush=True)
    with open(run_dir + ".log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        with open(run_dir + ".log") as log:
            tail = log.read()[-3000:]
        sys.exit(f"{tail}\nrouting_replay: the {arm} run failed (exit {done.returncode}); its log: {run_dir}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def median(history: list[dict], key: str) -> float:
    values = [h[key] for h in history if key in h]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three runs")
    parser.add_argument("--keep", help="keep the runs (run dirs and logs) here")
    parser.add_argument("--smoke", action="store_true", help="one round of 2 small steps: a check that it runs")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 2, 1
        args.overrides = [*SMOKE, *args.overrides]
    else:
        args.overrides = ["warm_start.steps=20", *args.overrides]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    print(f"routes per token (top-k expert ids of every MoE layer, int16), and per sample of {SAMPLE_TOKENS} tokens:")
    print(f"  {'model':<18} {'MoE layers':>10} {'top_k':>5} {'B/token':>8} {'MiB/sample':>10}  source")
    for name, hf in PUBLISHED.items():
        layers, top_k, per_token = routes_per_token(hf)
        print(f"  {name:<18} {layers:>10} {top_k:>5} {per_token:>8} {per_token * SAMPLE_TOKENS / MIB:>10.1f}  "
              f"{hf['source']}")
    tiny = tiny_hf_config(args.overrides)
    layers, top_k, tiny_per_token = routes_per_token(tiny)
    print(f"  {'tiny qwen3_moe':<18} {layers:>10} {top_k:>5} {tiny_per_token:>8} "
          f"{tiny_per_token * SAMPLE_TOKENS / MIB:>10.1f}  the runs' model (model.tiny, {tiny['num_experts']} experts)")

    root = args.keep or tempfile.mkdtemp(prefix="routing-replay-")
    os.makedirs(root, exist_ok=True)
    args.cache = os.path.join(root, "warm_start")
    histories: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    rewards: dict[str, list[tuple]] = {arm: [] for arm in ARMS}
    arms = list(ARMS)
    for r in range(args.repeats):
        order = arms[r % len(arms):] + arms[:r % len(arms)]      # drift on a busy machine hits each arm alike
        print(f"round {r + 1} of {args.repeats}:", flush=True)
        for arm in order:
            history = run(arm, os.path.join(root, f"{arm}-{r}"), args)
            histories[arm] += [h for h in history if h["step"] > 1]
            rewards[arm].append(tuple(h["reward/mean"] for h in history))
    with open(os.path.join(root, "off-0", "config.yaml")) as f:
        import yaml

        config = yaml.safe_load(f)
    rows = config["trainer"]["prompts_per_step"] * config["rollout"]["n"]

    steps = len(histories["off"])
    print(f"\nstep time, median over {steps} steps of each arm ({args.repeats} run(s) of {args.steps} steps, the "
          f"first left out), seconds:")
    print(f"  {'arm':<12} {'step':>7} {'x off':>6}" + "".join(f" {p:>12}" for p in PHASES))
    step = {arm: median(h, "time/step") for arm, h in histories.items()}
    for arm, history in histories.items():
        phases = [median(history, "time/" + p) for p in PHASES]
        print(f"  {arm:<12} {step[arm]:>7.3f} {step[arm] / step['off']:>6.2f}"
              + "".join(f" {'-' if s != s else format(s, '.3f'):>12}" for s in phases))
    same = all(r == rewards["off"][0] for runs in rewards.values() for r in runs)
    differs = median(histories["replay+live"], "routing/token_differs_frac")
    print(f"  rewards per step identical in every run: {'yes' if same else 'no'}; tokens routed live elsewhere than "
          f"the engine in some layer (routing/token_differs_frac, replay+live): median {differs:.4f}")

    width = round(median(histories["replay"], "prompt/length_max") + median(histories["replay"], "response/length_max"))
    routes, others = batch_bytes(rows, width, layers, top_k)
    print(f"\na step's batch as to_batch makes it ({rows} rows x {width} tokens, the median widest prompt + response): "
          f"routes {routes / KIB:.1f} KiB, its other tensors {others / KIB:.1f} KiB (routes / others "
          f"{routes / others:.2f}x); per token {tiny_per_token} B of routes against "
          f"{others / (rows * width):.1f} B of the rest (its per-row tensors spread over the width)")
    headline = routes_per_token(PUBLISHED[HEADLINE])[2]
    print(f"  at {HEADLINE}'s {headline} B/token the routes would be {headline / (others / (rows * width)):.0f}x the "
          f"rest of a batch of that shape")
    if not args.keep:
        shutil.rmtree(root)
    print(f"routing_replay: routes {headline} B/token ({HEADLINE}), step time with replay "
          f"{step['replay'] / step['off']:.2f}x, with replay and live-routing metrics "
          f"{step['replay+live'] / step['off']:.2f}x (tiny qwen3_moe, hf)")


if __name__ == "__main__":
    main()
