"""LoRA adapters on megatron-core's parallel linears (rlcore.lora.layers), on gloo at TP1, TP2 and TP2 with
sequence parallelism.

One linear of each kind with random non-zero A and B: its output (gathered) and the gradients of its input, A and B
equal the full-matrix LoRA x W^T + x A^T B^T * scale computed unsharded in plain torch; the base weight gets no
gradient and no all-gather ever sends it; adapters off give the base output exactly; with dropout, replicated
adapter gradients agree over TP ranks. A tiny Qwen3 GPTModel, and DeepSeek-V3's multi-latent attention
projections, with adapters set from per-projection (PEFT-style) adapters through the model's own weight
rules (their count is what --dry-run sizes): its logits equal those of the base model with the merged weights
W + B A * scale in every layout, and so agree between TP1 and TP2; so do the adapters' gradients after one backward
pass, mapped to per-projection tensors by the same rules."""
import re
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_jobs_by_world


LAYOUTS = {"tp1": (1, 0), "tp2": (2, 0), "tp2-sp": (2, 1)}   # processes (= TP), sequence parallel

LINEAR_JOB = textwrap.dedent("""
    import types, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import ModelParallelConfig, parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers, mappings
    from rlcore.lora.config import LoRAConfig
    from rlcore.lora.layers import adapters_enabled, attach_lora
    from rlcore.megatron.parallel import init_parallel

    sent = []   # what every all-gather sent while recording; the recorder passes every call on unchanged
    def recorded(gather):
        def wrapper(*args, **kwargs):
            if recording[0]:
                sent.append(args[1])
            return gather(*args, **kwargs)
        return wrapper
    recording = [False]
    mappings.dist_all_gather_func = recorded(mappings.dist_all_gather_func)
    layers.dist_all_gather_func = recorded(layers.dist_all_gather_func)
    dist.all_gather = recorded(dist.all_gather)
    dist.all_gather_into_tensor = recorded(dist.all_gather_into_tensor)

    def linear_job(tp, sp):   # an adapted linear of each kind at TP tp, sequence parallel or not
        init_parallel(tp=tp)
        rank, group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
        config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                                     gradient_accumulation_fusion=False)
        IN, OUT, R, S, B = 24, 32, 4, 6, 3

        def full(*shape, seed):
            return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        def part(t, dim):
            return t.chunk(tp, dim)[rank].contiguous()
        def gather(t, dim):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts, dim)
        def finalize(linear):   # megatron-core's TP reduction of the parameters tagged sequence_parallel (and norms)
            linear.ddp_config = DistributedDataParallelConfig()
            _allreduce_non_tensor_model_parallel_grads([linear], types.SimpleNamespace(sequence_parallel=sp,
                                                                                       qk_layernorm=False), group)
        def replica_spread(t):   # how far TP ranks' copies of a replicated tensor are apart
            copies = gather(t.unsqueeze(0), 0)
            return (copies - copies[0]).abs().max()

        W, A, Bm = full(OUT, IN, seed=1), full(R, IN, seed=2), full(OUT, R, seed=3)
        x, g = full(S, B, IN, seed=4), full(S, B, OUT, seed=5)
        cfg = LoRAConfig(rank=R, alpha=8.0)
        saved = {}
        for kind in ("column", "row"):
            def build(lora_cfg):
                if kind == "column":
                    linear = ColumnParallelLinear(IN, OUT, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                                  gather_output=False)
                    w, a, b = part(W, 0), A, part(Bm, 0)
                    x_in = part(x, 0) if sp else x                  # SP: this rank's sequence chunk
                else:
                    linear = RowParallelLinear(IN, OUT, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                               input_is_parallel=True, skip_bias_add=False)
                    w, a, b = part(W, 1), part(A, 1), Bm
                    x_in = part(x, 2)                               # split by features, like W's columns
                with torch.no_grad():
                    linear.weight.copy_(w)
                linear.weight.requires_grad_(False)
                x_in = x_in.clone().requires_grad_()
                base_out = linear(x_in)[0].detach()
                adapter = attach_lora(linear, lora_cfg, f"{kind}_linear")
                with torch.no_grad():
                    adapter.A.copy_(a)
                    adapter.B.copy_(b)
                return linear, adapter, x_in, base_out

            def output_and_grad(y):   # the whole output, and this rank's part of the output's gradient
                if kind == "column":
                    return gather(y, 2), part(g, 2)
                return (gather(y, 0), part(g, 0)) if sp else (y, g)

            linear, adapter, x_in, base_out = build(cfg)
            recording[0] = True
            y = linear(x_in)[0]
            y_local = y
            recording[0] = False
            y, g_local = output_and_grad(y_local)
            recording[0] = True
            (y_local * g_local).sum().backward()
            recording[0] = False
            finalize(linear)
            assert linear.weight.grad is None, "the frozen base weight got a gradient"
            w_shard = linear.weight
            assert sent or not sp, "no all-gather was recorded under SP (the recorder is not in the path)"
            assert not any(t.data_ptr() == w_shard.data_ptr() or t.shape == w_shard.shape for t in sent), \\
                [tuple(t.shape) for t in sent]
            if kind == "column":
                grad_a, grad_b = adapter.A.grad, gather(adapter.B.grad, 0)
                spread = replica_spread(adapter.A.grad)
                grad_x = gather(x_in.grad, 0) if sp else x_in.grad
            else:
                grad_a, grad_b = gather(adapter.A.grad, 1), adapter.B.grad
                spread = replica_spread(adapter.B.grad)
                grad_x = gather(x_in.grad, 2)
            with adapters_enabled(linear, False):
                off = linear(x_in)[0].detach()
            saved.update({f"{kind}.y": y, f"{kind}.grad_A": grad_a, f"{kind}.grad_B": grad_b, f"{kind}.grad_x": grad_x,
                          f"{kind}.replicated_grad_spread": spread.reshape(1),
                          f"{kind}.off_equals_base": torch.tensor([float(torch.equal(off, base_out))]),
                          f"{kind}.gathers_seen": torch.tensor([float(len(sent))])})
            sent.clear()

            # dropout: the replicated factor's gradient still agrees on every TP rank; eval() turns it off
            linear, adapter, x_in, _ = build(LoRAConfig(rank=R, alpha=8.0, dropout=0.5))
            y_train = linear(x_in)[0]
            (y_train * output_and_grad(y_train.detach())[1]).sum().backward()
            finalize(linear)
            spread = replica_spread(adapter.A.grad if kind == "column" else adapter.B.grad)
            linear.eval()
            y_eval = output_and_grad(linear(x_in)[0].detach())[0]
            saved.update({f"{kind}.dropout_replicated_grad_spread": spread.reshape(1), f"{kind}.dropout_eval_y": y_eval,
                          f"{kind}.dropout_changed_y": (output_and_grad(y_train.detach())[0] - y_eval).abs().max()
                          .reshape(1)})

        return saved
""")


def full_matrix_lora(scale: float = 2.0) -> dict:
    """The expected outputs and gradients, unsharded, in plain torch (the script's tensors, same seeds)."""
    def full(*shape, seed):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    IN, OUT, R, S, B = 24, 32, 4, 6, 3
    W, A, Bm = full(OUT, IN, seed=1), full(R, IN, seed=2), full(OUT, R, seed=3)
    x, g = full(S, B, IN, seed=4), full(S, B, OUT, seed=5)
    x, A, Bm = (t.clone().requires_grad_() for t in (x, A, Bm))
    y = x @ W.t() + (x @ A.t() @ Bm.t()) * scale
    (y * g).sum().backward()
    return {"y": y.detach(), "grad_A": A.grad, "grad_B": Bm.grad, "grad_x": x.grad}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
@pytest.mark.parallel
def test_adapted_linears_equal_full_matrix_lora(runs, layout):
    got = runs["linear", layout]
    want = full_matrix_lora()
    for kind in ("column", "row"):
        for name, expected in want.items():
            diff = (got[f"{kind}.{name}"] - expected).abs().max().item()
            assert diff <= 1e-5 * (1 + expected.abs().max().item()), (kind, name, diff)
        assert got[f"{kind}.replicated_grad_spread"].item() == 0.0, kind
        assert got[f"{kind}.off_equals_base"].item() == 1.0, f"{kind}: adapters off is not the base output exactly"
        assert got[f"{kind}.dropout_replicated_grad_spread"].item() == 0.0, f"{kind}: TP ranks' dropout masks differ"
        assert (got[f"{kind}.dropout_eval_y"] - want["y"]).abs().max().item() <= 1e-4, kind
        assert got[f"{kind}.dropout_changed_y"].item() > 1e-3, f"{kind}: dropout changed nothing in training"


GPT_JOB = textwrap.dedent("""
    import importlib, torch, torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from rlcore.lora.config import LoRAConfig
    from rlcore.lora.layers import ColumnLoRA, LoRAAdapter, adapters_enabled, add_lora
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel
    from rlcore.sizing import _moe_layers, adapter_params   # what --dry-run counts
    from rlcore.megatron.names import global_name
    from rlcore_testing.lora import set_random_adapters

    def gpt_job(path, tp, sp, plugin, spec_name, targets):
        # the checkpoint at path as a GPTModel of the plugin's spec at TP tp with adapters on targets: its logits in
        # every state, and the adapters' gradients
        SPEC, targets = getattr(importlib.import_module(plugin), spec_name), tuple(targets)
        init_parallel(tp=tp)
        group = mpu.get_tensor_model_parallel_group()
        hf_config, hf = read_hf_config(path), dict(read_hf_weights(path).items())
        ids = torch.randint(1, 16, (2, 8), generator=torch.Generator().manual_seed(1))

        def logits(model):   # [b, s, V], the vocabulary slices gathered
            with torch.no_grad():
                local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=group)
            return torch.cat(parts, -1)

        def built(weights):
            model, converter = build_gpt(SPEC, hf_config, sequence_parallel=sp)
            load_hf_into(model, converter, weights)
            return model.eval(), converter

        model, converter = built(hf)
        base = logits(model)
        cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
        params = add_lora(model, cfg)
        assert len(params) == 2 * len(targets) * hf_config["num_hidden_layers"], len(params)
        sized = sum(adapter_params(model.config, cfg.rank, targets, moe, tp) for moe in _moe_layers(model.config))
        assert sized == sum(p.numel() for p in params), (sized, sum(p.numel() for p in params))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in model.named_parameters() if ".lora." in n}, sorted(trainable)
        untouched = logits(model)   # B starts at zero: the base model

        # per-projection adapters as PEFT holds them (q/k/v or gate/up share A), put into the fused layout by the
        # model's own weight rules: B's rows split like W's rows, a row-parallel A's columns like W's columns
        merged = set_random_adapters(model, converter, hf, cfg, std=0.1)
        adapted = logits(model)
        with adapters_enabled(model, False):
            off = logits(model)
        reference, _ = built(merged)   # the base model with the merged weights W + B A * scale
        expected = logits(reference)

        # one backward pass of a loss every TP rank computes whole: it reaches the adapters only, and their gradients,
        # reduced as megatron-core's finalize_model_grads does and mapped to per-projection tensors by the weight rules,
        # are the same in every layout
        model.train()
        full = gather_from_tensor_model_parallel_region(model(ids, torch.arange(ids.shape[1]).expand_as(ids), None))
        (full * torch.randn(full.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        model.ddp_config = DistributedDataParallelConfig()
        _allreduce_non_tensor_model_parallel_grads([model], model.config, group)
        assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        grads = {}
        for name, module in model.named_modules():
            adapter = getattr(module, "lora", None)
            if isinstance(adapter, LoRAAdapter):
                rule = converter.rule(global_name(model, f"{name}.weight"))
                sharded, replicated = ("B", "A") if isinstance(adapter, ColumnLoRA) else ("A", "B")
                shards = [torch.empty_like(getattr(adapter, sharded).grad) for _ in range(tp)]
                dist.all_gather(shards, getattr(adapter, sharded).grad, group=group)
                grads.update({f"grad.{n}.lora_{sharded}": t.contiguous()
                              for n, t in rule.to_hf(shards, converter.layout)})
                grads[f"grad.{rule.megatron}.lora_{replicated}"] = getattr(adapter, replicated).grad
        return {"base": base, "untouched": untouched, "adapted": adapted, "off": off, "expected": expected, **grads}
""")


MLA = ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
# plugin, model spec, targets, per-projection gradient tensors (of both layers: B and A of each adapted HF weight)
MODELS = {"qwen3": ("rlcore_model_qwen3.plugin", "QWEN3", ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                    2 * (4 + 2 + 3 + 2)),   # q/k/v B + A, o_proj A + B, gate/up B + A, down_proj A + B
          # multi-latent attention with query compression: the down projections are column-parallel like the up
          # ones, their output gathered over TP
          "deepseek_v3": ("rlcore_model_deepseek.plugin", "DEEPSEEK_V3",
                          ("linear_q_down_proj", "linear_q_up_proj", *MLA), 2 * 5 * 2)}
# DeepSeek-V3 at TP2 with sequence parallelism only (megatron-core's MoE layers need it at TP > 1); Moonlight's
# linear_q_proj is checked against PEFT at TP1 and TP2 (test_lora_peft_equivalence.py)
CASES = [("qwen3", layout) for layout in sorted(LAYOUTS)] + [("deepseek_v3", "tp1"), ("deepseek_v3", "tp2-sp")]
TINY_MLA = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                ffn_hidden_size=32, max_position_embeddings=32)   # layer 0 dense, layer 1 MoE


# Every job of one world size, the linears' and the GPT models', runs in one torchrun (ranks.RUN_JOBS): a process
# start that imports Megatron costs more than a job. The linear jobs' all-gather recorder stays installed for the GPT
# jobs; it passes every call on unchanged and records only inside a linear job.
RANK_SCRIPT = LINEAR_JOB + GPT_JOB + RUN_JOBS


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_qwen3):
    """("linear", layout) and (model, layout) of CASES -> that job's tensors, all made in two torchruns."""
    import importlib

    from rlcore_testing.models import tiny_checkpoint

    tmp = tmp_path_factory.mktemp("lora")
    checkpoints = {"qwen3": tiny_qwen3, "deepseek_v3": tmp / "deepseek_v3"}
    tiny_checkpoint(getattr(importlib.import_module(MODELS["deepseek_v3"][0]), MODELS["deepseek_v3"][1]),
                    str(checkpoints["deepseek_v3"]), **TINY_MLA)
    jobs = {("linear", layout): (procs, {"run": "linear_job", "args": [procs, bool(sp)]})
            for layout, (procs, sp) in LAYOUTS.items()}
    for model, layout in CASES:
        procs, sp = LAYOUTS[layout]
        plugin, spec, targets, _ = MODELS[model]
        jobs[model, layout] = procs, {"run": "gpt_job", "args": [str(checkpoints[model]), procs, bool(sp), plugin,
                                                                  spec, targets]}
    return run_jobs_by_world(RANK_SCRIPT, tmp, jobs)


@pytest.mark.parametrize("model, layout", CASES)
@pytest.mark.slow
@pytest.mark.parallel
def test_adapted_gpt_equals_merged_weights_and_one_process(runs, model, layout):
    got, one_process = runs[model, layout], runs[model, "tp1"]
    assert torch.equal(got["untouched"], got["base"]), "fresh adapters (B = 0) changed the logits"
    assert torch.equal(got["off"], got["base"]), "adapters off is not the base model exactly"
    moved = (got["adapted"] - got["base"]).abs().max().item()
    assert moved > 0.1, moved
    assert (got["adapted"] - got["expected"]).abs().max().item() <= 1e-5 * (1 + moved)
    assert (got["adapted"] - one_process["adapted"]).abs().max().item() <= 1e-5 * (1 + moved)
    grads = sorted(n for n in got if n.startswith("grad."))
    assert grads == sorted(n for n in one_process if n.startswith("grad.")) and len(grads) == MODELS[model][3], grads
    for name in grads:
        want = one_process[name]
        assert want.abs().max() > 0, name
        assert (got[name] - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item()), name


@pytest.mark.parametrize("settings, message", [
    (dict(rank=0), "LoRA rank=0: must be a positive integer"),
    (dict(alpha=0.0), "LoRA alpha=0.0: must be positive"),
    (dict(dropout=1.0), "LoRA dropout=1.0: must be in [0, 1)"),
    (dict(target_modules=()), "LoRA target_modules is empty"),
    (dict(target_modules=("linear_qkv", "router")), "the MoE router is never adapted"),
    (dict(target_modules=("q_proj",)), "'q_proj', which is not a megatron-core linear rlcore adapts; choose from "
                                       "linear_qkv, linear_proj, linear_fc1, linear_fc2, linear_q_proj"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    from rlcore.lora.config import LoRAConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        LoRAConfig(**settings)
