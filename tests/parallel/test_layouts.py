"""Multi-process layouts on gloo, each worker a Ray actor hosting a Megatron shard and a vLLM engine shard.

For every layout: after every weight push the engine's logprobs on a fixed batch equal the actor's (the engine's
reusable check, on every rank), and after training the replicas that must agree do agree bit for bit."""
import contextlib
import os

import pytest
from runs import ON_REQUEST, ray_workers_forked

from rlcore.config import load_config
from rlcore.plugins import load_plugins
from rlcore.run import Run

pytestmark = [pytest.mark.slow, pytest.mark.parallel]
SHORT_WARM_START = ["warm_start.steps=20", "warm_start.target_accuracy=0"]   # enough for a logprob check
LAYOUTS = {
    "tp2": ["trainer.world_size=2", "actor.parallel.tp=2"],
    "pp2": ["trainer.world_size=2", "actor.parallel.pp=2"],
    "pp2-uneven": ["trainer.world_size=2", "actor.parallel.pp=2", "actor.parallel.last_stage_layers=1"],  # 3 + 1
    "dp2": ["trainer.world_size=2"],
    "tp2-rollout_tp2": ["trainer.world_size=2", "actor.parallel.tp=2", "rollout.tp=2"],
    "dp2-rollout_tp2": ["trainer.world_size=2", "rollout.tp=2"],
    "tp2xpp2": ["trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.pp=2"],
    "cp2": ["trainer.world_size=2", "actor.parallel.cp=2"],
    "tp2xcp2": ["trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.cp=2"],
    "tp2-sp": ["trainer.world_size=2", "actor.parallel.tp=2", "actor.parallel.sp=true"],
    # LoRA adapters split over TP (sequence-parallel tags on the replicated factors), merged weights pushed
    "tp2-sp-lora": ["trainer.world_size=2", "actor.parallel.tp=2", "actor.parallel.sp=true", "actor.lora.rank=8",
                    "actor.lora.alpha=16", "actor.optim.lr=0.001"],
    # the weight sync over torch.distributed broadcasts instead of shared memory (what multi-host runs use)
    "tp2-collectives": ["trainer.world_size=2", "actor.parallel.tp=2", "rollout.sync_transport=collectives"],
    # Qwen3-MoE, experts split over 2 ranks; a short warm start is enough for a logprob check
    "moe-ep2": ["model.family=qwen3_moe", *SHORT_WARM_START, "trainer.world_size=2", "actor.parallel.ep=2"],
    # LoRA on a MoE model's every target: attention and each routed expert (gradients over expert data parallelism)
    "moe-ep2-lora": ["model.family=qwen3_moe", *SHORT_WARM_START, "trainer.world_size=2", "actor.parallel.ep=2",
                     "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=0.001",
                     "actor.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"],
    "moe-ep2-rollout_tp2": ["model.family=qwen3_moe", *SHORT_WARM_START, "trainer.world_size=2",
                            "actor.parallel.ep=2", "rollout.tp=2"],
    # Qwen2: the QKV bias split over TP by whole query groups, in training and in the engine
    "qwen2-tp2-rollout_tp2": ["model.family=qwen2", *SHORT_WARM_START, "trainer.world_size=2", "actor.parallel.tp=2",
                              "rollout.tp=2"],
    # Qwen2-MoE (gated shared expert): experts over 2 ranks, the engine at TP2; on request
    # (the EP2 split is Qwen3-MoE's)
    "qwen2_moe-ep2-rollout_tp2": ["model.family=qwen2_moe", *SHORT_WARM_START, "trainer.world_size=2",
                                  "actor.parallel.ep=2", "rollout.tp=2"],
    # Llama 3.x (llama3-scaled RoPE) at TP2 on both sides: on request (nothing in it is split differently from Qwen3)
    "llama-tp2-rollout_tp2": ["model.family=llama", *SHORT_WARM_START, "trainer.world_size=2", "actor.parallel.tp=2",
                              "rollout.tp=2"],
}


def plugins_for(overrides, engine):
    """GRPO, the engine, and the model plugin of the layout's family (qwen3's unless it names another)."""
    family = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.family=")), "qwen3")
    return (family.split("_")[0], "grpo", engine)


def run_layout(tmp_path, cache, overrides, steps, engine="vllm"):
    plugins = plugins_for(overrides, engine)
    cfg = load_config("quickstart", [*overrides, f"trainer.steps={steps}", "trainer.check_logprobs_every=1",
                                     "trainer.eval_every=0", "trainer.export_hf=false", "run.progress=false",
                                     "trainer.loggers=[jsonl]", f"run.dir={tmp_path / 'run'}",
                                     f"warm_start.cache_dir={cache}"])
    # SGLang patches transformers as it is imported: its runs' workers start afresh (tests/zygote.py)
    with ray_workers_forked() if engine != "sglang" else contextlib.nullcontext():
        run = Run(cfg, load_plugins(list(plugins)))
        try:
            summary = run.train()
            return summary, run.workers.fingerprint(), _history(summary["run_dir"])
        finally:
            run.close()


def _history(run_dir):
    import json
    import os

    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def assert_replicas_agree(prints):
    by_coords = {}
    for p in prints:
        by_coords.setdefault((p["tp"], p["pp"], p["ep"]), []).append(p)
    for group in by_coords.values():   # data-parallel replicas of one shard
        assert all(g["sharded"] == group[0]["sharded"] and g["replicated"] == group[0]["replicated"]
                   and g["experts"] == group[0]["experts"] for g in group)
    by_stage = {}
    for p in prints:
        by_stage.setdefault(p["pp"], set()).add(p["replicated"])
    assert all(len(v) == 1 for v in by_stage.values()), "TP ranks disagree on replicated parameters"


# plain TP2 and PP2 run with SGLang generating (test_sglang_layouts.py); vLLM runs their variants: SP, collectives,
# rollout TP2, uneven stages
# on request (RLCORE_ALL_LAYOUTS=1), to keep the suite's time, each with what covers its parts in every run:
# (moe-ep2-lora: 114 s beside other jobs; the expert adapters' layouts and PEFT equivalence: test_lora_experts.py)
# tp2xpp2: test_two_ray_nodes (the same layout and checks, over two raylets); tp2-rollout_tp2: qwen2-tp2-rollout_tp2
# (the same split on both sides, with QKV biases) and dp2-rollout_tp2 (Qwen3's qk-norms into an engine at TP2);
# dp2: the TP2 layouts at rollout.tp=1 (two engine replicas fed from two ranks) and test_gradient_equivalence's dp2;
# tp2-sp: tp2-sp-lora (merged weights pushed from the same TP2 + SP layout)
# cp2: tp2xcp2 (context parallelism beside TP, pushed from the same CP ranks) and test_gradient_equivalence's cp2
VLLM_ON_REQUEST = ["llama-tp2-rollout_tp2", "qwen2_moe-ep2-rollout_tp2", "moe-ep2-lora", "tp2xpp2", "tp2-rollout_tp2",
                   "dp2", "tp2-sp", "cp2"]
VLLM_LAYOUTS = sorted(set(LAYOUTS) - {"tp2", "pp2"} - set(VLLM_ON_REQUEST))


@pytest.fixture
def stale_vllm_segments(layout):
    """For rollout.tp=2: the /dev/shm segments a killed tensor-parallel vLLM engine leaves under vLLM's own names,
    which every such engine on the host used to ask for (the next start failed: 'create shm ... errno: 17')."""
    import pathlib

    planted = []
    if "rollout.tp=2" in LAYOUTS[layout]:
        for rank in (0, 1):
            path = pathlib.Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{rank}")
            if not path.exists():
                path.write_bytes(b"left by a killed run")
                planted.append(path)
    yield
    for path in planted:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("layout", VLLM_LAYOUTS + [pytest.param(layout, marks=ON_REQUEST)
                                                  for layout in VLLM_ON_REQUEST])
def test_engine_matches_actor_after_every_sync(tmp_path, warm_start_cache, layout, stale_vllm_segments):
    summary, prints, history = run_layout(tmp_path, warm_start_cache, LAYOUTS[layout], steps=3)
    assert len(history) == 3
    assert all(h["check/logprob_max_diff"] < 1e-3 for h in history), [h["check/logprob_max_diff"] for h in history]
    assert all(h["sync/bytes"] > 0 for h in history[1:])   # steps 2 and 3 pushed the updated weights
    assert_replicas_agree(prints)


# on request: 50 steps on four workers (~220 s under CI load); in every run the quickstart learns in one process and
# one step at TP2, PP2 and the other layouts equals the one-process step (test_gradient_equivalence.py)
@ON_REQUEST
def test_tp2xpp2_learns_like_one_process(tmp_path, warm_start_cache):
    summary, prints, history = run_layout(tmp_path, warm_start_cache, LAYOUTS["tp2xpp2"], steps=50)
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.10, summary
    assert_replicas_agree(prints)


def test_two_ray_nodes(tmp_path, warm_start_cache):
    """Two raylets on this machine; TP2 x PP2 spread over both nodes trains with checked weight syncs (the checks of
    test_engine_matches_actor_after_every_sync, whose tp2xpp2 layout this is)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster()
    try:
        with ray_workers_forked():     # in the raylets' environment: they start the workers
            cluster.add_node(num_cpus=2)
            cluster.add_node(num_cpus=2)
        summary, prints, history = run_layout(
            tmp_path, warm_start_cache, LAYOUTS["tp2xpp2"] + [f"trainer.ray_address={cluster.address}",
                                                              "trainer.placement=spread"], steps=3)
        assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
        assert len(set(summary["worker_nodes"])) == 2, summary["worker_nodes"]   # workers on both nodes
        assert len(history) == 3
        assert all(h["check/logprob_max_diff"] < 1e-3 for h in history), [h["check/logprob_max_diff"] for h in history]
        assert all(h["sync/bytes"] > 0 for h in history[1:])   # steps 2 and 3 pushed the updated weights
        assert_replicas_agree(prints)
    finally:
        ray.shutdown()
        cluster.shutdown()
