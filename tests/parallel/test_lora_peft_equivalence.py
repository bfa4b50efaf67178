"""LoRA against transformers + PEFT (issue 29's acceptance): per model family and layout, an actor whose adapters are
random (B too) saves a checkpoint; ``rlcore export``'s PEFT adapter directory from it, loaded by
``PeftModel.from_pretrained`` onto transformers' model of the base checkpoint, gives the actor's logits; and one
update's adapter gradients (read off the update: Adam with beta1 = 0 and eps >> |g| moves a parameter by
lr * g / (|g| + eps), which inverts exactly), mapped to PEFT's layout by the same export, equal PEFT's ``lora_A`` /
``lora_B`` gradients of the same loss. A fused linear's A is shared by its projections' adapters, so its gradient is
the sum of theirs. The merged export (base weights from the HF checkpoint) equals PEFT's merge_and_unload.

One job per layout runs every family in turn (TP1, TP2; EP2 on the MoE families, their routed experts adapted too:
Megatron DDP reduces those over expert data parallelism); one torchrun per world size runs its layouts' jobs."""
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_jobs_by_world

from rlcore_testing.models import LOGIT_TOLERANCE, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

PLUGINS = ["qwen3", "qwen2", "llama", "mixtral", "deepseek"]
SIZES = dict(vocab_size=48, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             ffn_hidden_size=64, max_position_embeddings=32)
ATTENTION = ["linear_qkv", "linear_proj"]
DENSE = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
MLA = ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]   # PEFT's kv_a_proj_with_mqa, kv_b_proj, o_proj
# family -> (its tiny checkpoint's sizes, LoRA targets): the MoE families' attention and routed experts (PEFT's
# parameter LoRA on transformers' fused experts, a layer's experts stacked); DeepSeek-V3's and Moonlight's
# multi-latent attention with query compression (q_a_proj, q_b_proj) and without (q_proj). At TP2 the MoE families
# run with sequence parallelism (megatron-core requires it for MoE with TP in training), the dense ones without: both
# of the adapters' TP patterns
FAMILIES = {"qwen3": ({}, DENSE), "qwen2": ({}, DENSE), "llama": ({}, DENSE), "qwen3_moe": ({}, DENSE),
            "mixtral": ({}, DENSE),
            "deepseek_v3": (dict(num_layers=3, num_kv_heads=4), ["linear_q_down_proj", "linear_q_up_proj", *MLA]),
            "moonlight": (dict(num_layers=3, num_kv_heads=4), ["linear_q_proj", *MLA])}
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "ep2": (2, 1, 2)}   # name: (processes, tp, ep)
MOE = ["qwen3_moe", "mixtral", "deepseek_v3", "moonlight"]
PER_LAYOUT = {"tp1": list(FAMILIES), "tp2": list(FAMILIES), "ep2": ["qwen3_moe", "mixtral"]}
RANK, ALPHA = 4, 8.0
LR = EPS = 1000.0      # Adam's first update u = -lr * g / (|g| + eps): g = -u * eps / (lr - |u|)

RANK_SCRIPT = textwrap.dedent("""
    import os, zlib, torch
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file
    from megatron.core import parallel_state as mpu
    from rlcore.config.schema import ActorConfig, LoRASection, OptimConfig, ParallelConfig
    from rlcore.data import Batch
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import save_model
    from rlcore.lora.layers import ColumnLoRA
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.plugins import load_plugins
    from rlcore.megatron.reshard import adapted_weights
    registry = load_plugins(["qwen3", "qwen2", "llama", "mixtral", "deepseek"]).registry

    def layout_job(root, out, tp, ep, rank, lr, eps, alpha, families):
        # every family in turn at one layout (the parallel groups stay): the checkpoints before and after one
        # update into out, the logits before it returned
        all_logits = {}
        batch = Batch(load_file(os.path.join(root, "batch.safetensors")))
        for family in families:
            family, targets, sp = family.split(":")
            path = os.path.join(root, family)
            sgd_like = OptimConfig(lr=lr, adam_beta1=0.0, adam_eps=eps, clip_grad=0.0)
            cfg = ActorConfig(micro_batch_size=len(batch), optim=sgd_like,
                              parallel=ParallelConfig(tp=tp, ep=ep, sp=sp == "sp"),
                              lora=LoRASection(rank=rank, alpha=alpha, target_modules=targets.split(",")))
            actor = MegatronActor(registry.get("models", family), read_hf_config(path), cfg,
                                  registry.get("optimizers", "adam"), hf_state=read_hf_weights(path))
            tp_rank = mpu.get_tensor_model_parallel_rank()
            with torch.no_grad():   # B random too; the TP-split factor per rank, the replicated one equal on all ranks
                for name, adapter in adapted_weights(actor.model).items():
                    split = isinstance(adapter, ColumnLoRA) and adapter.tp_size > 1   # an expert's: whole (expert TP 1)
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (tp_rank if split else 0))
                    adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * 0.2)
            save_model(actor, os.path.join(out, family, "before"))
            dp, dp_rank = actor.dp_size, actor.dp_rank
            with torch.no_grad():   # padded at the end to a length sequence parallelism splits (causal: no effect)
                ids = batch["input_ids"]
                padded = torch.nn.functional.pad(ids, (0, -ids.shape[1] % tp))
                logits = actor.model(padded, torch.arange(padded.shape[1]).unsqueeze(0), None)[:, : ids.shape[1]]
                logits = gather_from_tensor_model_parallel_region(logits) if tp > 1 else logits
            share = batch.select(range(dp_rank * len(batch) // dp, (dp_rank + 1) * len(batch) // dp))
            tokens = float(batch["response_mask"].sum())
            actor.train_step(share, lambda lp, mb: (aggregate(-lp * mb["weight"], mb["response_mask"], "token-mean",
                                                              tokens, len(batch)), {}))
            save_model(actor, os.path.join(out, family, "after"))
            all_logits[family] = logits.contiguous()
            del actor      # the next family at the same layout: the parallel groups stay
        return all_logits
""") + RUN_JOBS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's tiny HF checkpoint, and the batch every layout trains on."""
    from safetensors.torch import save_file

    from rlcore.data import Batch, build_sequences
    from rlcore.plugins import load_plugins

    root = tmp_path_factory.mktemp("lora_peft")
    registry = load_plugins(PLUGINS).registry
    for family, (sizes, _) in FAMILIES.items():
        tiny_checkpoint(registry.get("models", family), str(root / family), **{**SIZES, **sizes})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 48, (3 + i % 3,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(1, 48, (2 + i % 4,), generator=g).tolist() for i in range(4)]
    batch = Batch(build_sequences(prompts, responses, pad_id=0))
    batch["weight"] = torch.rand(batch["input_ids"].shape, generator=g)   # every token's gradient differs
    save_file(batch.tensors, str(root / "batch.safetensors"))
    return root, registry, batch


@pytest.fixture(scope="module")
def layouts(checkpoints):
    """layout -> (the folder of its checkpoints, family -> the actor's logits): each layout's families in one job,
    the jobs of one world size in one torchrun (TP2 and EP2 share one)."""
    root = checkpoints[0]
    jobs = {}
    for layout, (procs, tp, ep) in LAYOUTS.items():
        families = [f"{f}:{','.join(FAMILIES[f][1])}:{'sp' if tp > 1 and f in MOE else '-'}"
                    for f in PER_LAYOUT[layout]]
        jobs[layout] = procs, {"run": "layout_job", "args": [str(root), str(root / layout), tp, ep, RANK, LR, EPS,
                                                             ALPHA, families]}
    results = run_jobs_by_world(RANK_SCRIPT, root, jobs)
    return {layout: (root / layout, logits) for layout, logits in results.items()}


def peft_side(path: str, adapter_dir: str, batch):
    """transformers' model of ``path`` with the PEFT adapter in ``adapter_dir``: its logits on the batch and the
    gradients of the actor's loss wrt each lora_A / lora_B (keyed as the adapter file keys them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.losses import aggregate

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).float()
    logp = torch.cat([logp, torch.zeros(len(ids), 1)], 1)            # label position t: token t + 1
    loss = aggregate(-logp * batch["weight"], batch["response_mask"], "token-mean",
                     float(batch["response_mask"].sum()), len(batch))
    loss.backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, model


def lora_config(family: str):
    from rlcore.lora.config import LoRAConfig

    return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(FAMILIES[family][1]))


def assert_equivalent(root, out, ours, registry, batch, family: str) -> tuple[float, float]:
    """The checks of the module docstring for one family's run; returns (max logit diff, max gradient diff)."""
    from rlcore.export import SavedModel, checkpoint_hf_weights, checkpoint_peft_adapter, write_peft_adapter
    from rlcore.lora.peft import peft_adapter, routed_expert
    from rlcore.hf_checkpoint import HFCheckpoint
    from rlcore.megatron.model import read_hf_config
    from rlcore.megatron.parallel import init_parallel

    init_parallel()       # the export reads the checkpoints in a world of one, as rlcore export does
    spec, path, lora = registry.get("models", family), str(root / family), lora_config(family)
    hf = read_hf_config(path)
    adapter_dir = str(out / family / "peft")
    write_peft_adapter(adapter_dir, *checkpoint_peft_adapter(str(out / family / "before"), spec, hf, "float32", lora,
                                                             path))
    logits, grads, peft_model = peft_side(path, adapter_dir, batch)
    assert ours.shape == logits.shape
    logit_diff = (ours - logits).abs().max().item()
    with torch.no_grad(), peft_model.disable_adapter():
        moved = (peft_model(input_ids=batch["input_ids"]).logits - logits).abs().max().item()
    assert moved > 0.1, f"{family}: the adapters barely change the logits ({moved})"
    assert logit_diff < LOGIT_TOLERANCE, f"{family}: actor logits differ from PEFT's by {logit_diff}"

    def adapter(step: str):
        """The checkpoint's adapter in PEFT's layout (as the export writes it; experts stacked, so their update
        inverts elementwise like the rest), and PEFT's key -> the keys whose lora_A is the same rlcore A."""
        weights = list(SavedModel(str(out / family / step), spec, hf, "float32", lora).peft_adapters())
        state = peft_adapter(((name, factors) for name, _, factors in weights), [])[0]
        siblings = {f"base_model.model.{m}.lora_A.weight": [f"base_model.model.{o}.lora_A.weight" for o, _, _ in f]
                    for name, column, f in weights if column and routed_expert(name) is None for m, _, _ in f}
        return state, siblings

    (before, _), (after, siblings) = adapter("before"), adapter("after")
    assert sorted(after) == sorted(grads), sorted(set(after) ^ set(grads))
    grad_diff = 0.0
    for key, value in after.items():
        update = value - before[key]
        ours_g = -update * EPS / (LR - update.abs())
        # a fused column adapter's A is each of its projections' lora_A: its gradient is the sum of theirs
        theirs = sum(grads[k] for k in siblings[key]) if key in siblings else grads[key]
        diff = (ours_g - theirs).abs().max().item()
        grad_diff = max(grad_diff, diff)
        assert theirs.abs().max() > 0, key
        assert diff <= 1e-5 + 1e-4 * theirs.abs().max().item(), (key, diff)

    _, stream = checkpoint_hf_weights(str(out / family / "before"), spec, hf, "float32", lora=lora,
                                      base=HFCheckpoint(path))
    # transformers 5 holds MoE experts fused in memory: the other tensors by name
    merged = peft_model.merge_and_unload().state_dict()
    compared = set()
    for name, tensor in stream:
        if name in merged:
            torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-6, msg=name)
            compared.add(name.removesuffix(".weight"))
    # (the stream writes the experts per expert, as the checkpoint holds them: their merge is the engine check's)
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in grads if ".experts." not in k}
    assert adapted <= compared, adapted - compared
    return logit_diff, grad_diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_actor_with_random_adapters_equals_transformers_with_peft(checkpoints, layouts, layout):
    root, registry, batch = checkpoints
    out, logits = layouts[layout]
    for family in PER_LAYOUT[layout]:
        logit_diff, grad_diff = assert_equivalent(root, out, logits[family], registry, batch, family)
        print(f"{layout} {family}: max logit diff {logit_diff:.1e}, max adapter gradient diff {grad_diff:.1e}")
