"""The Megatron actor with LoRA (``actor.lora``), on 2 gloo ranks at TP2 (and a TP1 baseline for the memory): what
it holds, what it sends the engine, its reference policy, its checkpoint.

- memory: Megatron DDP's gradient buffer and the optimizer's state hold the adapters only (a full fine-tuning actor
  of the same tiny Qwen3 beside it, for the ratio), as ``--dry-run`` estimates them; the frozen base weights are
  among the parameters that offload moves;
- weight sync: the HF tensors the LoRA actor streams (W + B A * scale merged per TP shard) loaded into a plain actor
  give that actor the LoRA actor's logprobs; the adapters alone (``rollout.lora=adapters``), gathered in PEFT's layout,
  give those merged weights;
- reference: with adapters the reference policy is the model with them off: no second model, and after updates its
  logprobs are still the starting model's;
- checkpoint: a fresh actor whose adapters start elsewhere (another seed) loads the saved adapters and optimizer state
  exactly on both TP ranks (the TP-split factors saved as shards, not as replicas of rank 0's half)."""
import pytest
import torch

from ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file
from rlcore.config.schema import ActorConfig, Config, LoRASection, OptimConfig, ParallelConfig, TrainerConfig
from rlcore.data import Batch, build_sequences
from rlcore.megatron.actor import MegatronActor
from rlcore.megatron.checkpoint import load_model, save_model
from rlcore.lora.layers import adapters
from rlcore.megatron.model import transformer_config
from rlcore.sizing import estimate
from rlcore.megatron.parallel import shutdown_parallel
from rlcore.lora.sync import AdapterSync
from rlcore_model_qwen3.plugin import QWEN3
from rlcore_plugins.optimizers import SPECS

out, directory = sys.argv[1], sys.argv[2]
tp = int(os.environ["WORLD_SIZE"])
hf = QWEN3.tiny_hf_config(vocab_size=2048, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                          ffn_hidden_size=512, max_position_embeddings=64)


def actor(lora_rank, seed=0):
    cfg = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2), parallel=ParallelConfig(tp=tp),
                      lora=LoRASection(rank=lora_rank, alpha=2.0 * lora_rank))
    return MegatronActor(QWEN3, hf, cfg, SPECS[0], hf_state=weights, seed=seed)


def held(a):
    # bytes of the distinct storages behind each kind (a storage shared with an earlier kind counts there)
    seen, sizes = set(), []
    for kind in ("params", "grads", "optimizer"):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in a._memory(kind)}
        sizes.append(sum(n for ptr, n in storages.items() if ptr not in seen))
        seen |= storages.keys()
    return sizes


batch = Batch(build_sequences([[1, 2, 3, 7], [5, 6, 9, 11]] * 2, [[4, 5, 8], [12, 13, 14]] * 2, pad_id=0))
loss = lambda lp, mb: (-(lp * mb["response_mask"]).sum() / 100, {})

full = MegatronActor(QWEN3, hf, ActorConfig(micro_batch_size=4, parallel=ParallelConfig(tp=tp)), SPECS[0])
weights = {n: t.clone() for n, t in full.hf_weights()}   # the starting HF weights every actor below loads
full.train_step(batch, loss)
lora = actor(8)
lora.freeze_reference()
before = lora.logprobs(batch)
for _ in range(3):
    lora.train_step(batch, loss)
rows = {"full_bytes": torch.tensor(held(full), dtype=torch.float64),
        "lora_bytes": torch.tensor(held(lora), dtype=torch.float64),
        "adapter_numel": torch.tensor([float(sum(p.numel() for a in adapters(lora.model) for p in (a.A, a.B)))]),
        "trainable_numel": torch.tensor([float(sum(p.numel() for p in lora.model.parameters() if p.requires_grad))]),
        "model_numel": torch.tensor([float(sum(p.numel() for p in lora.model.parameters()))])}
del full
config = Config(actor=ActorConfig(parallel=ParallelConfig(tp=tp), lora=LoRASection(rank=8, alpha=16.0)),
                trainer=TrainerConfig(world_size=tp))
planned = estimate(transformer_config(QWEN3, hf, "float32"), hf, config)["per_device"]
rows["lora_planned"] = torch.tensor([planned[k] for k in ("params", "grads", "optimizer")], dtype=torch.float64)

# reference = adapters off: still the starting model, no copy built
after = lora.logprobs(batch)
rows["reference"] = lora.logprobs(batch, reference=True)
rows["before"], rows["after"] = before, after
rows["reference_copies"] = torch.tensor([float(lora.reference is not None)])

# the merged weights it streams, loaded into a plain actor
merged = {n: t.clone() for n, t in lora.hf_weights()}
plain = MegatronActor(QWEN3, hf, ActorConfig(micro_batch_size=4, parallel=ParallelConfig(tp=tp)), SPECS[0],
                      hf_state=merged)
rows["plain_on_merged"] = plain.logprobs(batch)
rows["hf_names_equal"] = torch.tensor([float(sorted(merged) == sorted(weights))])
del plain

# the adapters alone (rollout.lora=adapters), gathered from both TP ranks in PEFT's layout: each projection's
# W + lora_B lora_A * scale is the merged weight the actor streams
sync = AdapterSync(lora.model, lora.converter, lora.lora_config(0), None)
peft = sync.tensors()
worst = 0.0
for key, a in peft.items():
    if key.endswith(".lora_A.weight"):
        module = key[len("base_model.model."):-len(".lora_A.weight")]
        delta = peft[key.replace(".lora_A.", ".lora_B.")] @ a * (16.0 / 8)
        worst = max(worst, float((weights[module + ".weight"] + delta - merged[module + ".weight"]).abs().max()))
rows["adapter_sync"] = torch.tensor([worst, float(len(peft)), float(sync.config["r"])])

# checkpoint at this layout, loaded into an actor whose adapters start elsewhere
save_model(lora, directory)
state = {n: p.detach().clone() for n, p in lora.model.named_parameters() if ".lora." in n}
opt = [t.clone() for t in lora._memory("optimizer")]
lora.train_step(batch, loss)
next_step = {n: p.detach().clone() for n, p in lora.model.named_parameters() if ".lora." in n}
resumed = actor(8, seed=1)
resumed.train_step(batch, lambda lp, mb: (lp.sum() * 0.0, {}))   # Adam's state exists to be loaded into
differed = max(float((p - state[n]).abs().max()) for n, p in resumed.model.named_parameters() if ".lora." in n)
load_model(resumed, directory)
loaded = max(float((p - state[n]).abs().max()) for n, p in resumed.model.named_parameters() if ".lora." in n)
resumed.updates = lora.updates - 1
resumed.train_step(batch, loss)
stepped = max(float((p - next_step[n]).abs().max()) for n, p in resumed.model.named_parameters() if ".lora." in n)
rows["resume"] = torch.tensor([differed, loaded, stepped])
gathered = {}
for key, value in rows.items():
    parts = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, value.contiguous())
    gathered[key] = torch.stack(parts)
if dist.get_rank() == 0:
    save_file(gathered, out)
shutdown_parallel()
"""


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_tp2")
    return run_ranks(RANK_SCRIPT, path, 2, path / "out.safetensors", path / "checkpoint")


def test_optimizer_and_gradients_hold_the_adapters_only(tp2):
    for rank in range(2):
        adapter_numel, trainable = float(tp2["adapter_numel"][rank]), float(tp2["trainable_numel"][rank])
        full_params, full_grads, full_opt = tp2["full_bytes"][rank].tolist()
        params, grads, opt = tp2["lora_bytes"][rank].tolist()
        print(f"rank {rank}: adapters {adapter_numel:.0f} of {float(tp2['model_numel'][rank]):.0f} parameters; "
              f"grad buffer {grads / 2**10:.1f} KiB vs {full_grads / 2**10:.1f} KiB full; optimizer state "
              f"{opt / 2**10:.1f} KiB vs {full_opt / 2**10:.1f} KiB full ({100 * opt / full_opt:.1f}%)")
        assert trainable == adapter_numel
        assert grads == adapter_numel * 4                  # fp32 gradient buffer, one slot per adapter parameter
        assert opt == adapter_numel * 4 * 2                # Adam's two moments (fp32 model: no separate master)
        assert opt < 0.2 * full_opt
        for kind, measured, planned in zip(("params", "grads", "optimizer"), tp2["lora_bytes"][rank].tolist(),
                                           tp2["lora_planned"][rank].tolist()):
            assert abs(planned - measured) <= 0.1 * measured, (kind, measured, planned)   # --dry-run's estimate


def test_reference_is_the_model_with_adapters_off(tp2):
    assert float(tp2["reference_copies"].max()) == 0.0
    mask = tp2["before"][0] != 0
    assert torch.equal(tp2["reference"][0], tp2["before"][0])   # the starting model (B = 0) exactly
    assert (tp2["after"][0] - tp2["before"][0])[mask].abs().max() > 1e-3   # the adapters did train


def test_merged_weights_give_the_lora_actor(tp2):
    assert float(tp2["hf_names_equal"].min()) == 1.0           # the same HF tensors, no adapter factors among them
    mask = tp2["after"][0] != 0
    assert (tp2["plain_on_merged"][0] - tp2["after"][0])[mask].abs().max() < 1e-5


def test_adapters_sent_alone_give_the_merged_weights(tp2):
    """rollout.lora=adapters: both ranks gather the same PEFT adapter, lora_A and lora_B of each of the 2 layers' 7
    projections (fused q/k/v and gate/up split), whose W + B A * scale equals the merged weight streamed at TP2."""
    assert torch.equal(tp2["adapter_sync"][0], tp2["adapter_sync"][1])
    worst, tensors, rank = tp2["adapter_sync"][0].tolist()
    assert (tensors, rank) == (2 * 2 * 7, 8)
    assert worst < 1e-6, worst


def test_checkpoint_at_tp2_resumes_exactly(tp2):
    for rank in range(2):
        differed, loaded, stepped = tp2["resume"][rank].tolist()
        assert differed > 0        # another seed: other adapters before the load
        assert loaded == 0.0, rank
        assert stepped == 0.0, rank
