"""Checkpoints survive kill -9: a run killed at a random step after its first save, then resumed with
`rlcore run --resume`, logs exactly what the uninterrupted run logged (every metric but timings, bit for bit on CPU);
a run killed while a checkpoint is being written resumes from the previous one, the partial one ignored."""
import json
import os
import random
import sys

import pytest
import torch

from runs import ENV, EVERY, ON_REQUEST, STEPS, kill_when, logged, rlcore_run, run_cli, run_to_end, without_timings

CASES = {   # at world size 1; PPO with its critic and an adaptive KL coefficient; TP2 x PP2 on four Ray workers;
            # LoRA (rank 8) at TP2 with a KL reference on two
    "grpo": [],  # (its export at the end in HF's sharded layout, 1 MB files)
    "ppo": ["algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.kl_target=0.01"],
    "tp2xpp2": ["trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.pp=2",
                "trainer.export_max_shard_gb=0.001"],
    # LoRA adapters split over TP2 (their own checkpoint shards), the KL reference = adapters off
    "lora-tp2": ["trainer.world_size=2", "actor.parallel.tp=2", "actor.lora.rank=8", "actor.lora.alpha=16",
                 "actor.optim.lr=0.001", "algorithm.kl_coef=0.01"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, warm_start_cache):
    """The metrics each case logs without interruption (run once per case, on first use)."""
    runs: dict[str, tuple] = {}

    def history(case, run_dir=False):
        if case not in runs:
            directory = tmp_path_factory.mktemp(f"uninterrupted-{case}")
            run_to_end(rlcore_run(directory, warm_start_cache, *CASES[case]))
            runs[case] = directory, logged(directory)
            assert len(runs[case][1]) == STEPS
            assert [h["step"] for h in runs[case][1] if "time/save" in h] == [EVERY + 1]   # the save after step 4
        return runs[case][0] if run_dir else runs[case][1]
    return history


# tp2xpp2 on request (RLCORE_ALL_LAYOUTS=1), to keep the suite's time (three 4-worker runs, ~500 s under CI load): in
# every run, lora-tp2 kills and resumes a multi-worker run, test_resharded_resume saves and loads pipeline stages'
# weights and optimizer state exactly, and the export test below reads a two-step tp2xpp2 run's checkpoint.
# ppo on request too: test_resharded_resume's critic cases save and load the critic's weights and optimizer state
# exactly, and lora-tp2 kills and resumes a run with a KL reference policy


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, marks=[ON_REQUEST] if c in ("tp2xpp2", "ppo") else [])
                                  for c in sorted(CASES)])
def test_killed_at_a_random_step_and_resumed_logs_what_the_uninterrupted_run_logged(tmp_path, warm_start_cache,
                                                                                 uninterrupted, case):
    kill_at = random.randint(EVERY + 1, STEPS - 1)
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / f"step_{EVERY:08d}"     # written while step 5 runs: complete after it
    kill_when(rlcore_run(run_dir, warm_start_cache, *CASES[case]),
              lambda: len(logged(run_dir)) >= kill_at and first.exists())
    resumed = run_to_end(rlcore_run(run_dir, warm_start_cache, "--resume"))
    assert f"resuming from {run_dir}/checkpoints/step_0000000" in resumed.stderr
    assert without_timings(logged(run_dir)) == without_timings(uninterrupted(case)), f"killed after step {kill_at}"


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, warm_start_cache, uninterrupted):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"

    def saving():
        names = sorted(os.listdir(root)) if root.exists() else []
        return names if any(n.startswith(f".partial-step_{2 * EVERY:08d}-") for n in names) else None

    seen = kill_when(rlcore_run(run_dir, warm_start_cache), saving)
    assert seen[1:] == [f"step_{EVERY:08d}"], seen          # the kill came mid-save
    assert not (root / f"step_{2 * EVERY:08d}").exists()
    resumed = run_to_end(rlcore_run(run_dir, warm_start_cache, "--resume"))
    assert f"resuming from {root}/step_{EVERY:08d}" in resumed.stderr   # not from the partial one
    assert without_timings(logged(run_dir)) == without_timings(uninterrupted("grpo"))
    assert sorted(os.listdir(root)) == [f"step_{EVERY:08d}", f"step_{2 * EVERY:08d}"]


@pytest.mark.slow
@pytest.mark.e2e
def test_export_writes_the_actor_of_a_checkpoint_saved_at_another_layout(tmp_path, warm_start_cache):
    """A TP2 x PP2 run's last checkpoint (two steps, saved after the second), exported in one process with no model
    built (read from the distributed checkpoint a bucket at a time) and no engine, in 1 MB files, equals the HF export
    the run wrote from its live actor at the end in 1 MB files, tensor for tensor; transformers loads it with the
    tokenizer, and vLLM serves it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def read(directory):
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        assert len(files) >= 3 and os.path.exists(directory / "model.safetensors.index.json"), files
        return {name: t for f in files for name, t in load_file(directory / f).items()}

    run_dir = tmp_path / "run"
    run_to_end(rlcore_run(run_dir, warm_start_cache, *CASES["tp2xpp2"], "trainer.steps=2", "trainer.save_every=2",
                          "trainer.eval_every=0"))
    out = tmp_path / "exported"
    result = run_cli([sys.executable, "-m", "rlcore.cli", "export", "--plugins=qwen3", "--max-shard-gb=0.001",
                      str(run_dir / "checkpoints" / f"step_{2:08d}"), str(out)],
                     timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    exported, live = read(out), read(run_dir / "hf")
    assert sorted(exported) == sorted(live)
    assert all(torch.equal(exported[name], live[name]) for name in live)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("37+45=82")])
    reference = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    logits = model(ids).logits
    assert torch.equal(logits, reference(ids).logits)
    # vLLM serves the exported files: its teacher-forced logprobs equal transformers'
    from rlcore_testing.contract import RegisteredBackend
    from rlcore_testing.rollout_pytest import score_in_child

    vllm = RegisteredBackend("vllm", max_model_len=model.config.max_position_embeddings)
    served = torch.tensor(score_in_child(vllm, str(out), [ids[0].tolist()], [1])[0])
    expected = torch.log_softmax(logits[0, :-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0]
    assert (served - expected).abs().max() < 1e-4, (served, expected)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(tmp_path, uninterrupted):
    """The LoRA run's checkpoint holds the adapters and their optimizer state, not the frozen base (a fraction of
    its bytes), and records the base it applies to; a resume onto other base weights is refused by file name."""
    import shutil

    from megatron.core.dist_checkpointing import load_tensors_metadata

    from rlcore.checkpoint import STATE, check_compatible
    from rlcore.lora.base import base_fingerprint
    from rlcore.errors import ConfigError

    checkpoint = uninterrupted("lora-tp2", run_dir=True) / "checkpoints" / f"step_{STEPS:08d}"
    keys = list(load_tensors_metadata(str(checkpoint / "actor" / "model")))
    assert keys and all(".lora." in key for key in keys), [k for k in keys if ".lora." not in k][:4]
    state = json.loads((checkpoint / STATE).read_text())
    base = state["model"]["path"]
    assert state["model"]["base"] == base_fingerprint(base) and state["model"]["base"]
    saved = sum(f.stat().st_size for f in (checkpoint / "actor").rglob("*") if f.is_file())
    weights = sum(size for size, _ in state["model"]["base"].values())
    assert saved < weights / 2, (saved, weights)
    args = (str(checkpoint), state["model"]["family"], state["model"]["hf_config"], state["plugins"], state["config"])
    check_compatible(*args, base)
    other = tmp_path / "other-base"
    shutil.copytree(base, other)
    weights_file = sorted(other.glob("*.safetensors"))[-1]
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1                    # the last tensor's last byte: same names, same sizes, other weights
    weights_file.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"differs in {weights_file.name}: set model.path to the base"):
        check_compatible(*args, str(other))


def test_which_checkpoint_a_run_resumes_from(tmp_path):
    from rlcore.checkpoint import STATE, resolve_resume
    from rlcore.errors import ConfigError

    root = tmp_path / "checkpoints"
    assert resolve_resume(str(tmp_path), "") is None and resolve_resume(str(tmp_path), "auto") is None
    with pytest.raises(ConfigError, match="has no complete checkpoint"):
        resolve_resume(str(tmp_path), "latest")
    for name, complete in (("step_00000003", True), ("step_00000006", True), ("step_00000009", False),
                           (".partial-step_00000012", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / STATE).write_text("{}")
    newest = str(root / "step_00000006")      # step 9 has no state file, the partial one is not a checkpoint
    assert resolve_resume(str(tmp_path), "auto") == newest == resolve_resume(str(tmp_path), "latest")
    assert resolve_resume(str(tmp_path), str(root / "step_00000003")) == str(root / "step_00000003")
    with pytest.raises(ConfigError, match="already has checkpoints .newest: step 6.: continue it with `rlcore run "
                                          "--resume"):
        resolve_resume(str(tmp_path), "")
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        resolve_resume(str(tmp_path), str(root / "step_00000009"))


def test_generator_states_round_trip_through_json():
    import numpy as np
    import torch

    from rlcore.megatron.checkpoint import rng_state, set_rng_state
    from rlcore.megatron.parallel import init_parallel

    init_parallel()
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()          # the generators move on ...
    set_rng_state(state)                                       # ... and are put back
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_resume_of_a_directory_that_is_not_a_run_is_one_line(tmp_path):
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--resume", str(tmp_path)],
                     timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"rlcore: error: --resume {str(tmp_path)!r}: not a run "
                                                      f"directory (no config.yaml)")


@pytest.fixture(scope="module")
def run_with_a_checkpoint(tmp_path_factory):
    """A run directory as a run leaves it (config.yaml, a complete checkpoint's state) over a tiny Qwen3 model, and
    the state as that run saved it; what the workers would load is not needed: the refusals come before them."""
    from rlcore.checkpoint import STATE
    from rlcore.config import load_config, save_config, to_dict
    from rlcore.megatron.model import read_hf_config
    from rlcore.plugins import load_plugins
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    tmp = tmp_path_factory.mktemp("refusals")
    model = tmp / "model"
    tiny_checkpoint(QWEN3, str(model), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_hidden_size=64, max_position_embeddings=32)
    write_char_tokenizer(str(model))
    run_dir = tmp / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    cfg = load_config(None, [f"model.path={model}", f"run.dir={run_dir}"])
    save_config(cfg, str(run_dir / "config.yaml"))
    state = {"step": 2, "model": {"family": "qwen3", "hf_config": read_hf_config(str(model))},
             "plugins": load_plugins(["qwen3", "grpo", "vllm"]).describe(), "config": to_dict(cfg)}
    return run_dir, run_dir / "checkpoints" / "step_00000002" / STATE, state


@pytest.mark.parametrize("change, message", [
    ({"family": "mixtral"}, "is of model family 'mixtral', this run's is 'qwen3'"),
    ({"hidden_size": 64}, "is of another architecture than model.path: hidden_size 64 -> 32"),
    ({"plugins": "ppo"}, "was written with plugins builtin,grpo,ppo,qwen3,vllm; this run loads builtin,grpo,qwen3,vllm "
                         "(select them with --plugins)"),
])
def test_a_checkpoint_of_another_model_or_plugin_set_is_refused_in_one_line(run_with_a_checkpoint, change, message):
    run_dir, state_file, state = run_with_a_checkpoint
    saved = json.loads(json.dumps(state))
    if "family" in change:
        saved["model"]["family"] = change["family"]
    if "hidden_size" in change:
        saved["model"]["hf_config"]["hidden_size"] = change["hidden_size"]
    if "plugins" in change:
        saved["plugins"].append({"name": change["plugins"]})
    state_file.write_text(json.dumps(saved))
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "--resume",
                      str(run_dir)], timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    force = "; resume anyway with trainer.resume_strict=false"
    assert errors == [f"rlcore: error: checkpoint {state_file.parent} {message}{force}"], result.stderr[-3000:]


class RunsCode:
    """A pickle that, when loaded by plain pickle, creates a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("planted", [".metadata", "common.pt"])
def test_a_crafted_checkpoint_file_is_refused_and_runs_no_code(tmp_path, planted):
    """A checkpoint whose metadata (torch.distributed.checkpoint's pickle) or megatron-core's common.pt has been
    replaced with a pickle that calls a function: loading refuses it, and the function never ran."""
    import pickle

    from rlcore.config.schema import ActorConfig
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model, save_model
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS

    hf = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                              ffn_hidden_size=64, max_position_embeddings=16)
    actor = MegatronActor(QWEN3, hf, ActorConfig(micro_batch_size=2), SPECS[0])
    assert not save_model(actor, str(tmp_path / "ckpt"))       # before its first step the optimizer has no state
    load_model(actor, str(tmp_path / "ckpt"), with_optimizer=False)      # as saved, it loads
    marker = tmp_path / "code-ran"
    if planted == ".metadata":
        (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        torch.save({"x": RunsCode(marker)}, tmp_path / "ckpt" / "common.pt")
    with pytest.raises(BaseException) as refused:      # torch.distributed.checkpoint raises a BaseException
        load_model(actor, str(tmp_path / "ckpt"), with_optimizer=False)
    failures = getattr(refused.value, "failures", {})          # torch.distributed.checkpoint wraps per rank
    said = str(refused.value) + "".join(str(f) for f in failures.values())
    expected = ("checkpoint metadata names io.open, which is not checkpoint metadata: refused" if planted == ".metadata"
                else "Weights only load failed")
    assert expected in said, said[-2000:]
    assert not marker.exists()
