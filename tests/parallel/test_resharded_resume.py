"""Resume at another parallel layout: a checkpoint saved at TP2 x PP2 (4 processes) loads at TP1 (1 process) and the
reverse, for the actor with its optimizer state, for the critic, and for an actor with LoRA adapters (the TP-split
factors stored in a layout every TP size reads: a gated fc1's B as megatron-core stores its W, gates then ups). The
loaded weights equal the saved ones exactly (so the logprobs agree to TP numerics), and one more update at the new
layout equals the update the old layout made within the gradient-equivalence tolerance of
test_gradient_equivalence.py."""
import textwrap

import pytest
import torch
from ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from rlcore.config.schema import ActorConfig, LoRASection, OptimConfig, ParallelConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model, save_model
    from rlcore.megatron.critic import MegatronCritic
    from rlcore.megatron.model import read_hf_weights
    from rlcore.megatron.parallel import shutdown_parallel
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS
    out, mode, path, ckpt, role, tp, pp = sys.argv[1:6] + [int(x) for x in sys.argv[6:8]]
    hf = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, ffn_hidden_size=64, max_position_embeddings=32)
    cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                      parallel=ParallelConfig(tp=tp, pp=pp), lora=LoRASection(rank=4 if role == "lora" else 0))
    cls = MegatronCritic if role == "critic" else MegatronActor
    # the loading side starts from other weights (seed 1, no checkpoint): everything must come from the load; with
    # LoRA it starts from the base weights, as a resumed run does (the checkpoint holds the adapters only)
    model = cls(QWEN3, hf, cfg, SPECS[0], hf_state=read_hf_weights(path) if mode == "save" or role == "lora" else None,
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
    result = {**{f"loaded/{k}": v for k, v in loaded.items()}, **{f"next/{k}": v for k, v in view().items()}}
    if dist.get_rank() == 0:
        save_file(result, out)
    del model
    shutdown_parallel()
""")


def run(tmp_path, mode, hf_checkpoint, checkpoint, role, procs, tp, pp):
    """``mode`` save: from the HF checkpoint, three updates, then save ``checkpoint``; load: from ``checkpoint``.
    Either way, then the view of the model (weights, per-token outputs) and one more update's."""
    return run_ranks(RANK_SCRIPT, tmp_path, procs, tmp_path / f"{role}-{mode}-tp{tp}pp{pp}.safetensors", mode,
                     hf_checkpoint, checkpoint, role, tp, pp)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_qwen3):
    return tmp_path_factory.mktemp("reshard"), tiny_qwen3


LAYOUTS = {"tp2xpp2": (4, 2, 2), "tp1": (1, 1, 1)}


@pytest.mark.parametrize("role, saved_at, loaded_at", [("actor", "tp2xpp2", "tp1"), ("actor", "tp1", "tp2xpp2"),
                                                       ("critic", "tp2xpp2", "tp1"), ("lora", "tp2xpp2", "tp1"),
                                                       ("lora", "tp1", "tp2xpp2")])
def test_resume_at_another_layout(checkpoint, role, saved_at, loaded_at):
    tmp, hf_checkpoint = checkpoint
    saved = run(tmp, "save", hf_checkpoint, tmp / f"{role}-at-{saved_at}", role, *LAYOUTS[saved_at])
    resumed = run(tmp, "load", hf_checkpoint, tmp / f"{role}-at-{saved_at}", role, *LAYOUTS[loaded_at])
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
