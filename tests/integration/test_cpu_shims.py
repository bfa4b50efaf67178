"""Every megatron-core shim (rlcore.megatron.patches) is still needed: without it, building and training a tiny model
fails in the smallest case that uses it, the one its registry entry names (dense, MoE, DeepSeek-V3's multi-latent
attention, a checkpoint saved asynchronously while training goes on and loaded into a fresh optimizer, a crafted
checkpoint that would run code when loaded, the hybrid CPU/GPU optimizer against the plain one and through a
checkpoint; over 2 processes: MoE with expert parallelism, context parallelism, TP with sequence parallelism, and
DeepSeek-V3 at TP2 with SP, whose positional key's gradient is checked against finite differences); with all
of them, every case trains (and the resumed updates equal the uninterrupted ones bit for bit). Each case runs in
processes of its own because the shims patch megatron-core process-wide (forked from one that imported it,
unpatched)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from runs import run_cli

from rlcore.megatron import patches
from rlcore.megatron.patches import registry

# One process imports megatron-core and the model code once, unpatched (the shims are applied when a model's
# parallel state is first set up, rlcore.megatron.parallel.init_parallel), then forks for every job: a job pops the
# shims it runs without and builds and trains its case, in processes as fresh as a new one's for what the shims patch,
# without paying ~8 s of imports per process; a two-process case forks its two ranks, which meet over gloo.
RUNNER = textwrap.dedent("""
    import json, os, signal, sys, time, traceback, types
    import torch
    from rlcore.launch import free_port
    from rlcore.megatron import patches
    from rlcore.config.schema import ActorConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore_model_deepseek.plugin import DEEPSEEK_V3
    from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
    from rlcore_plugins.optimizers import SPECS
    import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed

    def run_case(case, prefix):
        spec = DEEPSEEK_V3 if case.startswith("mla") else QWEN3_MOE if case.startswith("moe") else QWEN3
        hf = spec.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 head_dim=16, ffn_hidden_size=64, max_position_embeddings=16)
        parallel = ParallelConfig(ep=2 if case == "moe-ep2" else 1, cp=2 if case == "cp2" else 1,
                                  tp=2 if case.endswith("tp2-sp") else 1, sp=case.endswith("tp2-sp"))
        actor = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, parallel=parallel), SPECS[0])
        # responses long enough that every context-parallel rank holds some of their tokens
        batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5, 6, 7, 8, 9]] * 4, pad_id=0))
        def train(actor, steps):
            return [actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 24.0, 4),
                                                            {"loss": float(-(lp * mb["response_mask"]).sum())}))["loss"]
                    for _ in range(steps)]
        if case == "mla-tp2-sp":   # the KV down projection's positional rows get their whole gradient (all TP ranks'
            # heads): autograd's directional derivative along them equals the finite difference of the loss
            import torch.distributed as dist
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
            model = actor.model.eval()
            ids = torch.randint(1, 16, (2, 8), generator=torch.Generator().manual_seed(0))
            weights = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            def loss():
                return (gather_from_tensor_model_parallel_region(model(ids, torch.arange(8).expand_as(ids), None))
                        .double() * weights).sum()
            w = model.decoder.layers[0].self_attention.linear_kv_down_proj.weight
            direction = torch.zeros_like(w)
            if dist.get_rank() == 1:   # the last rows of the whole weight: the positional key's
                direction[-hf["qk_rope_head_dim"]:] = torch.randn(hf["qk_rope_head_dim"], w.shape[1])
            grad, = torch.autograd.grad(loss(), [w])
            along = (grad.double() * direction).sum().reshape(1)
            dist.all_reduce(along)
            with torch.no_grad():   # (fp32 losses: a smaller step is lost in rounding; without the shim 2x off)
                w.add_(direction, alpha=3e-2)
                up = loss()
                w.add_(direction, alpha=-6e-2)
                down = loss()
                w.add_(direction, alpha=3e-2)
            finite = (up - down).item() / 6e-2
            assert abs(finite - along.item()) <= 1e-2 * abs(finite), (finite, along.item())
            actor.model.train()
        losses = train(actor, 3)
        assert losses[-1] < losses[0], losses
        if case == "checkpoint":   # saved, then loaded into a fresh actor: the next updates are the same, bit for bit
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            from rlcore.megatron.checkpoint import load_model, save_model
            pending = AsyncCallsQueue()
            save_model(actor, prefix + ".ckpt", pending=pending)   # written while the actor trains on
            expected = train(actor, 3)
            pending.maybe_finalize_async_calls(blocking=True)
            fresh = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, parallel=parallel), SPECS[0], seed=1)
            load_model(fresh, prefix + ".ckpt")
            resumed = train(fresh, 3)
            assert resumed == expected, (resumed, expected)
        if case == "hybrid":       # hybrid_adam, half the optimizer on the host: the same updates, bit for bit
            from rlcore.config.schema import OptimConfig
            hybrid_adam = next(s for s in SPECS if s.name == "hybrid_adam")
            hybrid = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, parallel=parallel, optim=OptimConfig(
                name="hybrid_adam", offload_fraction=0.5)), hybrid_adam)
            assert type(hybrid.optimizer.optimizer).__name__ == "HybridDeviceOptimizer"
            assert train(hybrid, 3) == losses
            assert all(torch.equal(a, b) for a, b in zip(actor.model.parameters(), hybrid.model.parameters()))
            from rlcore.megatron.checkpoint import load_model, save_model
            save_model(hybrid, prefix + ".ckpt")            # and through a checkpoint, as the checkpoint case
            expected = train(hybrid, 2)
            fresh = MegatronActor(spec, hf, ActorConfig(micro_batch_size=2, parallel=parallel, optim=OptimConfig(
                name="hybrid_adam", offload_fraction=0.5)), hybrid_adam, seed=1)
            load_model(fresh, prefix + ".ckpt")
            assert train(fresh, 2) == expected
        if case == "crafted-checkpoint":   # a checkpoint whose metadata pickle calls a function: refused, never called
            import pickle
            from rlcore.megatron.checkpoint import load_model, save_model
            class RunsCode:
                def __reduce__(self):
                    return (open, (prefix + ".ran", "w"))
            save_model(actor, prefix + ".ckpt")
            with open(prefix + ".ckpt/.metadata", "wb") as f:
                pickle.dump(RunsCode(), f)
            try:
                load_model(actor, prefix + ".ckpt", with_optimizer=False)
            except BaseException as e:       # torch.distributed.checkpoint raises a BaseException
                print("refused:", type(e).__name__)
            assert not os.path.exists(prefix + ".ran"), "loading the checkpoint ran its code"
        print("TRAINED", losses)

    def rank(job, rank, world, port):
        # one rank of the job in this forked process: its output to the job's log, its outcome the exit status
        log = os.open(job["prefix"] + f".rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if world == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                del os.environ[key]
        # __main__ is a script without an `if __name__ == "__main__"` guard, as the case's own script was: what
        # spawns a process from here (a multiprocessing Manager through the spawn context) gets it re-run, and fails
        main = types.ModuleType("__main__")
        main.__file__ = job["prefix"] + ".unguarded.py"
        with open(main.__file__, "w") as f:
            f.write("raise SystemExit('the script that spawned this process has no __main__ guard')\\n")
        sys.modules["__main__"] = main
        status = 1
        try:
            torch.set_num_threads(1)
            for name in job["skip"]:
                patches.SHIMS.pop(name)
            run_case(job["case"], job["prefix"])
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def run_jobs(jobs):
        results = {}
        for job in jobs:
            port = free_port()
            pids = []
            for r in range(job["world"]):
                pid = os.fork()
                if pid == 0:
                    rank(job, r, job["world"], port)
                pids.append(pid)
            deadline, codes = time.monotonic() + job["timeout"], {}
            while len(codes) < len(pids) and time.monotonic() < deadline:
                for pid in set(pids) - set(codes):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
                time.sleep(0.05)
            for pid in set(pids) - set(codes):   # hung: a timeout, neither a pass nor a failure
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            results[job["prefix"]] = ("timed out" if len(codes) < len(pids) else
                                      "trained" if all(code == 0 for code in codes.values()) else "failed")
        return results

    if __name__ == "__main__":
        json.dump(run_jobs(json.load(open(sys.argv[1]))), open(sys.argv[2], "w"))
""")

CASES = {name: shim.needed_by for name, shim in patches.SHIMS.items()}
MULTI_PROCESS = ("moe-ep2", "cp2", "tp2-sp", "mla-tp2-sp")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case with all shims, and each shim's case without it: "trained", "failed" or "timed out", with the
    job's log (its ranks' output), by (case, shim left out or None)."""
    tmp = tmp_path_factory.mktemp("shims")
    jobs = {(case, None): [] for case in set(CASES.values())} | {(case, shim): [shim] for shim, case in CASES.items()}
    listed = [dict(case=case, skip=skip, prefix=str(tmp / f"job{i}"), world=2 if case in MULTI_PROCESS else 1,
                   timeout=300) for i, ((case, _), skip) in enumerate(jobs.items())]
    (tmp / "jobs.json").write_text(json.dumps(listed))
    (tmp / "runner.py").write_text(RUNNER)
    result = run_cli([sys.executable, str(tmp / "runner.py"), str(tmp / "jobs.json"), str(tmp / "out.json")],
                     {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp / "out.json").read_text())

    def log(job):
        return "".join(open(p).read() for p in sorted(tmp.glob(os.path.basename(job["prefix"]) + ".rank*.log")))
    return {key: (results[job["prefix"]], log(job)) for key, job in zip(jobs, listed)}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES.values())))
def test_all_shims_train(outcomes, case):
    outcome, log = outcomes[case, None]
    assert outcome == "trained" and "TRAINED" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("shim", sorted(CASES))
def test_each_shim_is_still_needed(outcomes, shim):
    outcome, log = outcomes[CASES[shim], shim]
    assert outcome != "timed out", log[-3000:]
    assert outcome == "failed", f"megatron-core trained ({CASES[shim]}) without shim {shim!r}: remove the shim"


def test_every_shim_records_its_version_why_and_case():
    assert len(patches.SHIMS) >= 20
    for name, shim in patches.SHIMS.items():
        assert shim.written_for == "0.16.1" and len(shim.why.split()) >= 10, name
        assert shim.needed_by in ("dense", "moe", "moe-ep2", "cp2", "tp2-sp", "mla", "mla-tp2-sp", "checkpoint",
                                  "crafted-checkpoint", "hybrid"), name


def test_the_driver_lists_the_shims_without_applying_them():
    """What run.json records is read from the registry: in a fresh process (no CUDA, no TransformerEngine here) every
    shim is planned, and listing them neither imports megatron-core nor patches anything."""
    code = ("import sys, json, torch; from rlcore.megatron import patches; rows = patches.describe(); "
            "assert 'megatron.core' not in sys.modules; "
            "assert torch.Tensor.type(torch.zeros(1)) == 'torch.FloatTensor'; print(json.dumps(rows))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    import json
    assert json.loads(result.stdout) == [dict(name=n, megatron_core="0.16.1") for n in patches.SHIMS]


def test_another_megatron_core_version_warns_in_one_line_naming_the_shims(monkeypatch, caplog):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    shims = list(patches.SHIMS.values())[:2]
    with caplog.at_level("WARNING", logger=registry.__name__):
        registry.warn_unverified(shims)
    assert [r.getMessage() for r in caplog.records] == [
        f"megatron-core 0.17.0 is installed; these shims were written for 0.16.1 and not verified for it: "
        f"{shims[0].name}, {shims[1].name} (tests/integration/test_cpu_shims.py checks each is still needed)"]
    caplog.clear()
    monkeypatch.setattr(megatron.core, "__version__", "0.16.1")
    registry.warn_unverified(shims)
    assert not caplog.records
