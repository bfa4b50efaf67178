"""Resume at another parallel layout: a checkpoint saved at TP2 x PP2 (4 processes) loads at TP1 (1 process) and the
reverse, for the actor with its optimizer state, for the critic, and for an actor with LoRA adapters (the TP-split
factors stored in a layout every TP size reads: a gated fc1's B as megatron-core stores its W, gates then ups). The
loaded weights equal the saved ones exactly (so the logprobs agree to TP numerics), and one more update at the new
layout equals the update the old layout made within the gradient-equivalence tolerance of
test_gradient_equivalence.py."""
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_rank_jobs

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

# The jobs of one world size run in one torchrun, one after another (ranks.RUN_JOBS): a process start importing
# Megatron costs far more than these steps. Saves must precede the loads that read them, so three starts: the TP1
# saves, then the TP2 x PP2 saves and the loads of the TP1 checkpoints, then the loads of the TP2 x PP2 ones at TP1.
RANK_SCRIPT = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from rlcore.config.schema import ActorConfig, LoRASection, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model, save_model
    from rlcore.megatron.critic import MegatronCritic
    from rlcore.megatron.model import read_hf_weights
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS

    def resume(mode, path, ckpt, role, tp, pp):
        hf = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                  head_dim=16, ffn_hidden_size=64, max_position_embeddings=32)
        cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                          parallel=ParallelConfig(tp=tp, pp=pp), lora=LoRASection(rank=4 if role == "lora" else 0))
        cls = MegatronCritic if role == "critic" else MegatronActor
        # the loading side starts from other weights (seed 1, no checkpoint): everything must come from the load;
        # with LoRA it starts from the base weights, as a resumed run does (the checkpoint holds the adapters only)
        model = cls(QWEN3, hf, cfg, SPECS[0],
                    hf_state=read_hf_weights(path) if mode == "save" or role == "lora" else None,
                    seed=0 if mode == "save" else 1)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 16, (3 + i % 3,), generator=g).tolist() for i in range(8)]
        responses = [torch.randint(1, 16, (2 + i % 4,), generator=g).tolist() for i in range(8)]
        batch = Batch(build_sequences(prompts, responses, pad_id=0))
        batch["returns"] = torch.randn(batch["input_ids"].shape, generator=g)
        dp, rank = model.dp_size, model.dp_rank
        share = batch.select(range(rank * len(batch) // dp, (rank + 1) * len(batch) // dp))
        tokens = float(batch["response_mask"].sum())

        def update():
            if role != "critic":
                model.train_step(share, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", tokens,
                                                                  len(batch)), {}))
            else:
                model.train_step(share, lambda v, mb: (aggregate((v - mb["returns"]).square(), mb["response_mask"],
                                                                 "token-mean", tokens, len(batch)), {}))

        def view():
            if role != "critic":
                return {"logprobs": model.logprobs(batch) * batch["response_mask"],
                        **{n: t.contiguous().clone() for n, t in model.hf_weights()}}
            return {"values": model.values(batch) * batch["response_mask"]}

        if mode == "save":
            for _ in range(3):     # Adam's moments and step count are part of what the next update depends on
                update()
            save_model(model, ckpt)
        else:
            load_model(model, ckpt)
        loaded = view()
        update()
        return {**{f"loaded/{k}": v for k, v in loaded.items()}, **{f"next/{k}": v for k, v in view().items()}}
""") + RUN_JOBS

LAYOUTS = {"tp2xpp2": (4, 2, 2), "tp1": (1, 1, 1)}   # processes, TP, PP
CASES = [("actor", "tp2xpp2", "tp1"), ("actor", "tp1", "tp2xpp2"), ("critic", "tp2xpp2", "tp1"),
         ("lora", "tp2xpp2", "tp1"), ("lora", "tp1", "tp2xpp2")]   # role, saved at, loaded at
STARTS = [[("save", "tp1")], [("save", "tp2xpp2"), ("load", "tp2xpp2")], [("load", "tp1")]]   # (mode, layout) each


@pytest.fixture(scope="module")
def resumes(tmp_path_factory, tiny_qwen3):
    """(case, mode) -> that run's result. ``mode`` save: from the HF checkpoint, three updates, then save the
    case's checkpoint; load: from it. Either way, then the view of the model (weights, per-token outputs) and one
    more update's."""
    tmp = tmp_path_factory.mktemp("reshard")
    results = {}
    for i, start in enumerate(STARTS):
        keys = [(case, mode) for mode, layout in start for case in CASES if case[1 if mode == "save" else 2] == layout]
        procs, tp, pp = LAYOUTS[start[0][1]]
        jobs = [{"run": "resume", "args": [mode, str(tiny_qwen3), str(tmp / f"{role}-at-{saved_at}"), role, tp, pp]}
                for (role, saved_at, _), mode in keys]
        directory = tmp / f"start{i}"
        directory.mkdir()
        results.update(zip(keys, run_rank_jobs(RANK_SCRIPT, directory, procs, jobs)))
    return results


@pytest.mark.parametrize("role, saved_at, loaded_at", CASES)
def test_resume_at_another_layout(resumes, role, saved_at, loaded_at):
    saved, resumed = (resumes[(role, saved_at, loaded_at), mode] for mode in ("save", "load"))
    assert sorted(saved) == sorted(resumed)
    for name in saved:
        if name.startswith("loaded/") and "logprobs" not in name and "values" not in name:
            assert torch.equal(saved[name], resumed[name]), f"{name}: the loaded weights differ from the saved ones"
    per_token = "values" if role == "critic" else "logprobs"
    assert (saved[f"loaded/{per_token}"] - resumed[f"loaded/{per_token}"]).abs().max() <= 1e-5
    moved = [(n, (saved[f"next/{n[7:]}"] - saved[n]).abs().max().item()) for n in saved if n.startswith("loaded/")]
    assert max(m for _, m in moved) > 1e-3, "the update after the resume changed nothing"
    for name, step in moved:
        after = name.replace("loaded/", "next/")
        assert (resumed[after] - saved[after]).abs().max().item() <= 1e-5 + 1e-4 * step, after
